"""`batchgen bench --workload score`: scoring given continuations (task: loglikelihood) against the
prefill of their contexts alone, and against HF transformers scoring the same pairs.

The workload: `num_requests` contexts of random token ids (lengths in [input_len_min, input_len_max],
seeded), each with NUM_CONTINUATIONS continuations of `output_len` random tokens. Every engine side runs
on a fresh engine over the same weights (an empty prefix cache):
- context: each context alone, as a request that stops after its first token (the cost to beat);
- score: each context with its continuations (LLMEngine.add_score_request: the context computed once,
  its blocks shared by its continuations, the partial last one copied);
- separate: each (context, continuation) pair as its own request with prompt_logprobs, as a server
  answers lm-evaluation-harness (the prefix cache is not used for positions that owe log-probabilities);
- pairs, no logprobs: the same pairs as plain requests, their contexts' full blocks from the prefix
  cache (separate minus this: the cost of recomputing cached positions for their logits).
The peer: HF transformers' forward over each context's pairs (one batch of NUM_CONTINUATIONS equal-length
rows), the continuations' log-softmax gathered, as lm-evaluation-harness' `hf` backend scores them.
The figure: score seconds / context seconds (the goal: below 1.5 at 4 continuations of 500 tokens).
Contexts take one step's token budget at a time and continuations run once their context is computed,
so a context's continuations share a step with the next contexts' prefill: only the last contexts'
continuations run alone (a step of a few hundred tokens, several times the per-token cost of a full
one on the CPU). Fewer contexts than two steps' budget measure mostly that tail.
"""

from __future__ import annotations

import gc
import random
import time
from collections.abc import Callable

import torch

from batchgen.bench.machine import cpu_busy_fraction, machine_fingerprint
from batchgen.bench.workloads import special_token_ids
from batchgen.engine import LLMEngine, SamplingParams

NUM_CONTINUATIONS = 4
DEFAULT_NUM_CONTEXTS = 32


def score_workload(num_contexts: int, input_len_min: int, input_len_max: int, continuation_len: int, seed: int,
                   vocab_size: int, excluded: set[int]) -> list[tuple[list[int], list[list[int]]]]:
    """(context ids, continuation ids) per context: random non-special tokens, a seed gives the same set."""
    rng = random.Random(seed)
    allowed = [t for t in range(vocab_size) if t not in excluded]
    items = []
    for _ in range(num_contexts):
        context = rng.choices(allowed, k=rng.randint(input_len_min, input_len_max))
        items.append((context, [rng.choices(allowed, k=continuation_len) for _ in range(NUM_CONTINUATIONS)]))
    return items


def _fresh(engine: LLMEngine, items) -> LLMEngine:
    """An engine over the same weights with an empty prefix cache and a pool that holds every context
    with its continuations at once (the scored side's working set; the pair sides queue for blocks as a
    server's requests would). The default CPU pool, 4 GiB per engine, is far more than a side needs."""
    gc.collect()  # the previous side's pool goes before this one is allocated
    block = engine.config.block_size
    num_tokens = sum(len(context) + len(cs) * (len(cs[0]) + 2 * block) for context, cs in items)
    num_tokens = max(num_tokens, engine.max_model_len)
    return LLMEngine(engine.config.replace(kv_cache_memory=num_tokens * engine.kv_bytes_per_token), weights_from=engine)


def _run(engine: LLMEngine) -> tuple[dict, float]:
    outputs = {}
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out
    return outputs, time.perf_counter() - start


def run_contexts(engine: LLMEngine, items) -> float:
    engine = _fresh(engine, items)
    params = SamplingParams(temperature=0, max_tokens=1)
    for i, (context, _) in enumerate(items):
        engine.add_request(f"context-{i}", None, params, prompt_token_ids=context)
    return _run(engine)[1]


def run_scores(engine: LLMEngine, items) -> tuple[list[list[tuple[float, bool]]], float, dict]:
    engine = _fresh(engine, items)
    for i, (context, continuations) in enumerate(items):
        engine.add_score_request(f"score-{i}", context, continuations)
    outputs, seconds = _run(engine)
    scores = [[(c.sum_logprob, c.is_greedy) for c in outputs[f"score-{i}"].continuations] for i in range(len(items))]
    stats = engine.stats
    return scores, seconds, {"num_prefill_tokens": stats["num_prefill_tokens"],
                             "num_block_copies": stats["num_block_copies"]}


def run_pairs_cached(engine: LLMEngine, items) -> float:
    """Each pair as a plain request (no log-probabilities): its context's full blocks from the prefix
    cache. Beside `separate`, what recomputing the cached positions for their logits costs."""
    engine = _fresh(engine, items)
    params = SamplingParams(temperature=0, max_tokens=1)
    for i, (context, continuations) in enumerate(items):
        for j, continuation in enumerate(continuations):
            engine.add_request(f"pair-{i}-{j}", None, params, prompt_token_ids=context + continuation)
    return _run(engine)[1]


def run_separate(engine: LLMEngine, items) -> tuple[list[list[tuple[float, bool]]], float]:
    engine = _fresh(engine, items)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    for i, (context, continuations) in enumerate(items):
        for j, continuation in enumerate(continuations):
            engine.add_request(f"pair-{i}-{j}", None, params, prompt_token_ids=context + continuation)
    outputs, seconds = _run(engine)
    scores = []
    for i, (context, continuations) in enumerate(items):
        row = []
        for j, continuation in enumerate(continuations):
            positions = outputs[f"pair-{i}-{j}"].prompt_logprobs[len(context):]
            entries = [p[t] for p, t in zip(positions, continuation)]
            row.append((sum(e.logprob for e in entries), all(e.rank == 1 for e in entries)))
        scores.append(row)
    return scores, seconds


@torch.no_grad()
def run_peer(hf_model, items) -> tuple[list[list[tuple[float, bool]]], float]:
    scores = []
    start = time.perf_counter()
    for context, continuations in items:
        batch = torch.tensor([context + c for c in continuations])  # (k, L + C)
        num = len(continuations[0])
        logits = hf_model(batch, logits_to_keep=num + 1).logits[:, :-1].float()  # (k, C, V)
        log_softmax = torch.log_softmax(logits, dim=-1)
        targets = torch.tensor(continuations)  # (k, C)
        values = log_softmax.gather(-1, targets[..., None]).squeeze(-1)
        greedy = (log_softmax.argmax(-1) == targets).all(-1)
        scores.append(list(zip(values.sum(-1).tolist(), greedy.tolist())))
    return scores, time.perf_counter() - start


def _agreement(ours, theirs) -> dict:
    pairs = [(a, b) for row_a, row_b in zip(ours, theirs) for a, b in zip(row_a, row_b)]
    return {"max_abs_sum_diff": max(abs(a[0] - b[0]) for a, b in pairs),
            "is_greedy_equal": sum(a[1] == b[1] for a, b in pairs), "num_pairs": len(pairs)}


def run_score_bench(engine: LLMEngine, hf_model, *, num_contexts: int, input_len_min: int, input_len_max: int,
                    continuation_len: int, seed: int, say: Callable[[str], None]) -> dict:
    busy_before = cpu_busy_fraction()
    items = score_workload(num_contexts, input_len_min, input_len_max, continuation_len, seed,
                           engine.model_cfg.vocab_size, special_token_ids(engine.tokenizer.hf))
    warmup = score_workload(2, 32, 48, 4, seed + 7919, engine.model_cfg.vocab_size, set())
    run_scores(engine, warmup)
    say(f"context alone: {num_contexts} contexts")
    context_s = run_contexts(engine, items)
    say(f"score: {num_contexts} x {NUM_CONTINUATIONS} continuations")
    scores, score_s, score_stats = run_scores(engine, items)
    say("separate: the same pairs as prompt_logprobs requests")
    separate, separate_s = run_separate(engine, items)
    say("pairs without log-probabilities (prefix cache)")
    pairs_cached_s = run_pairs_cached(engine, items)
    result = {
        "workload": {"name": "score", "num_contexts": num_contexts, "num_continuations": NUM_CONTINUATIONS,
                     "context_len_min": input_len_min, "context_len_max": input_len_max,
                     "continuation_len": continuation_len, "seed": seed,
                     "num_context_tokens": sum(len(c) for c, _ in items)},
        "engine": {"context_s": context_s, "score_s": score_s, "separate_s": separate_s,
                   "pairs_cached_s": pairs_cached_s,
                   "score_over_context": score_s / context_s, "separate_over_context": separate_s / context_s,
                   **score_stats},
        "separate_agreement": _agreement(scores, separate),
        "machine": {**machine_fingerprint(), "cpu_busy_before": busy_before},
    }
    if hf_model is not None:
        say("peer: HF transformers over the same pairs")
        peer, peer_s = run_peer(hf_model, items)
        result["peer"] = {"seconds": peer_s, "peer_over_score": peer_s / score_s}
        result["agreement"] = _agreement(scores, peer)
    return result


def format_score_report(result: dict) -> str:
    w, e = result["workload"], result["engine"]
    head = (f"score: {w['num_contexts']} contexts of {w['context_len_min']}-{w['context_len_max']} tokens x "
            f"{w['num_continuations']} continuations of {w['continuation_len']} tokens")
    shared = (f"  scored (shared)        {e['score_s']:8.2f} s   {e['score_over_context']:.2f}x the contexts alone "
              f"({e['num_block_copies']} block copies)")
    lines = [head, f"  contexts alone         {e['context_s']:8.2f} s", shared,
             (f"  pairs, prompt_logprobs {e['separate_s']:8.2f} s   {e['separate_over_context']:.2f}x "
              "(the prefix cache not used for owed positions)"),
             (f"  pairs, no logprobs     {e['pairs_cached_s']:8.2f} s   (the prefix cache used: what the "
              "recomputation costs is the difference)")]
    if "peer" in result:
        a = result["agreement"]
        lines.append(f"  HF transformers        {result['peer']['seconds']:8.2f} s   "
                     f"{result['peer']['peer_over_score']:.2f}x the engine's scoring")
        lines.append(f"  agreement with HF: max |sum difference| {a['max_abs_sum_diff']:.2e}, is_greedy equal "
                     f"on {a['is_greedy_equal']} of {a['num_pairs']}")
    return "\n".join(lines)
