"""`batchgen bench --workload copy`: speculative decoding where answers copy their prompts.

The committed copy prompts (bench/copy_prompts.py) through the chat template, greedy, each answer
ending at EOS or max_tokens (the model's own answer, not a fixed length: a copy ends where the copy
ends). Speculation off, `ngram` and `draft_model` at running batches 1, 8 and 64 in one run, each
mode in a fresh engine over the same weights, outputs checked identical to speculation off; HF
transformers' prompt lookup decoding (`generate(prompt_lookup_num_tokens=k)`, batch 1, greedy) and
its plain `generate` as the peer. Then the batch switch: the random workload at running batch 64
with speculation configured (default `disable_by_batch_size`) against off, 3 interleaved runs each.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from batchgen.bench.copy_prompts import copy_prompts
from batchgen.bench.engine_side import fixed_length_params, run_engine
from batchgen.bench.machine import cpu_busy_fraction, machine_fingerprint
from batchgen.bench.result import TimedRun, compare_outputs
from batchgen.bench.workloads import BenchRequest, Workload, random_workload, special_token_ids
from batchgen.engine import LLMEngine, SamplingParams
from batchgen.pipeline.summary import speculative_summary

COPY_BATCHES = (1, 8, 64)
NUM_SWITCH_REPEATS = 3
# The batch switch runs the README's random workload: 64 requests, prompts of 100-200 tokens, 64 out.
SWITCH_INPUT_LENS, SWITCH_OUTPUT_LEN = (100, 200), 64


def copy_workload(engine: LLMEngine, num_requests: int, max_tokens: int) -> Workload:
    """The 16 copy prompts, cycled to `num_requests` (repeats under their own ids)."""
    prompts = copy_prompts()
    ids = [engine.tokenizer.encode_messages([{"role": "user", "content": p}]) for p in prompts]
    requests = [BenchRequest(f"copy-{i}", ids[i % len(ids)], max_tokens) for i in range(num_requests)]
    return Workload("copy", requests, {"max_tokens": max_tokens, "num_prompts": len(prompts)})


def _run_greedy(engine: LLMEngine, workload: Workload, name: str) -> TimedRun:
    """Greedy to EOS or max_tokens; completion tokens over wall seconds."""
    params = SamplingParams(temperature=0, max_tokens=workload.requests[0].output_len)
    before = engine.stats["speculative"]
    outputs = {}
    start = time.perf_counter()
    for r in workload.requests:
        engine.add_request(r.request_id, None, params, prompt_token_ids=r.prompt_token_ids)
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out
    seconds = time.perf_counter() - start
    tokens = {rid: list(o.outputs[0].token_ids) for rid, o in outputs.items()}
    figures = speculative_summary(before, engine.stats["speculative"])  # the _SUCCESS figures
    details = figures.to_dict() if figures is not None else {}
    prompt_tokens = sum(len(r.prompt_token_ids) for r in workload.requests)
    return TimedRun(name, prompt_tokens, sum(map(len, tokens.values())), seconds, tokens, details)


def _peer_prompt_lookup(hf_model, workload: Workload, k: int | None, pad_token_id: int,
                        eos_token_ids: list[int]) -> TimedRun:
    """HF generate one request at a time, greedy, with prompt lookup (k) or without (None)."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=workload.requests[0].output_len, do_sample=False, num_beams=1,
                              pad_token_id=pad_token_id, eos_token_id=eos_token_ids,
                              bos_token_id=hf_model.config.bos_token_id, use_cache=True,
                              prompt_lookup_num_tokens=k)
    eos = set(eos_token_ids)
    tokens: dict[str, list[int]] = {}
    start = time.perf_counter()
    with torch.inference_mode():
        for r in workload.requests:
            ids = torch.tensor([r.prompt_token_ids])
            row = hf_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                    generation_config=config)[0, ids.shape[1]:].tolist()
            n = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            tokens[r.request_id] = row[:n]
    seconds = time.perf_counter() - start
    name = f"HF generate, prompt lookup {k}" if k else "HF generate"
    return TimedRun(name, sum(len(r.prompt_token_ids) for r in workload.requests),
                    sum(map(len, tokens.values())), seconds, tokens, {"batch_size": 1})


def run_copy_bench(engine: LLMEngine, hf_model, *, num_speculative_tokens: int, draft_model: str,
                   max_tokens: int, num_requests_at_batch_1: int, switch_output_len: int,
                   say: Callable[[str], None], draft_quantization: str | None = None,
                   batches: tuple[int, ...] = COPY_BATCHES) -> dict:
    """The copy workload at each running batch in `batches` (the batch-64 switch check only when 64
    is among them), the HF peer at batch 1 when `hf_model` is given (batch 1 must then be run)."""
    busy_before = cpu_busy_fraction()
    modes = {
        "off": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": num_speculative_tokens},
        "draft_model": {"method": "draft_model", "model": draft_model, "quantization": draft_quantization,
                        "num_speculative_tokens": num_speculative_tokens},
    }
    runs: dict[str, dict] = {}
    batch_1_runs: dict[str, TimedRun] = {}
    for batch in batches:
        workload = copy_workload(engine, max(batch, num_requests_at_batch_1), max_tokens)
        off_run = None
        for mode, spec in modes.items():
            if spec is not None:
                spec = {**spec, "disable_by_batch_size": batch}  # speculate at this batch
            side = LLMEngine(engine.config.replace(max_num_seqs=batch, speculative=spec), weights_from=engine)
            _run_greedy(side, copy_workload(engine, 2, 8), "warmup")
            say(f"copy, batch {batch}, {mode}: {workload.num_requests} requests")
            run = _run_greedy(side, workload, f"{mode} (batch {batch})")
            say(f"  {run.completion_tokens_per_s:.1f} completion tokens/s {run.details}")
            entry = run.as_dict()
            if off_run is None:
                off_run = run
            else:
                entry["speedup_vs_off"] = run.completion_tokens_per_s / off_run.completion_tokens_per_s
                entry["identical_to_off"] = compare_outputs(run, off_run).as_dict()
            runs[f"{mode}@{batch}"] = entry
            if batch == 1:
                batch_1_runs[mode] = run
            del side

    peer = {}
    if hf_model is not None and 1 in batches:
        workload = copy_workload(engine, num_requests_at_batch_1, max_tokens)
        eos = list(engine.eos_token_ids)
        pad = engine.tokenizer.hf.pad_token_id
        pad = eos[0] if pad is None else pad
        for k in (None, num_speculative_tokens):
            say(f"peer: HF generate batch 1, prompt lookup {k}")
            run = _peer_prompt_lookup(hf_model, workload, k, pad, eos)
            say(f"  {run.completion_tokens_per_s:.1f} completion tokens/s")
            peer["prompt_lookup" if k else "plain"] = {
                **run.as_dict(), "identical_to_engine_off": compare_outputs(run, batch_1_runs["off"]).as_dict()}
        ngram = batch_1_runs["ngram"].completion_tokens_per_s
        peer["ngram_vs_hf_prompt_lookup"] = ngram / peer["prompt_lookup"]["completion_tokens_per_s"]
        peer["hf_prompt_lookup_vs_hf_plain"] = (peer["prompt_lookup"]["completion_tokens_per_s"]
                                                / peer["plain"]["completion_tokens_per_s"])

    result = {"workload": "copy", "max_tokens": max_tokens, "num_speculative_tokens": num_speculative_tokens,
              "draft_model": draft_model, "draft_quantization": draft_quantization, "runs": runs, "peer": peer,
              "batch_switch": None, "machine": {**machine_fingerprint(), "cpu_busy_before": busy_before}}
    if 64 in batches:
        result["batch_switch"] = _batch_switch(engine, num_speculative_tokens, switch_output_len, say)
    return result


def _batch_switch(engine: LLMEngine, num_speculative_tokens: int, output_len: int,
                  say: Callable[[str], None]) -> dict:
    """Random prompts at running batch 64, speculation configured at its default switch, vs off."""
    switch_output_len = output_len
    vocab = engine.model_cfg.vocab_size
    random = random_workload(64, *SWITCH_INPUT_LENS, switch_output_len, 0, vocab,
                             special_token_ids(engine.tokenizer.hf))
    ratios, per_mode = [], {"off": [], "ngram": []}
    for repeat in range(NUM_SWITCH_REPEATS):
        seconds = {}
        for mode in ("off", "ngram"):
            spec = None if mode == "off" else {"method": "ngram", "num_speculative_tokens": num_speculative_tokens}
            side = LLMEngine(engine.config.replace(max_num_seqs=64, speculative=spec), weights_from=engine)
            run = run_engine(side, random, f"random {mode}")
            seconds[mode] = run.completion_tokens_per_s
            per_mode[mode].append(run.completion_tokens_per_s)
            say(f"random batch 64, {mode}, repeat {repeat}: {run.completion_tokens_per_s:.1f} tokens/s")
        ratios.append(seconds["ngram"] / seconds["off"])
    return {"workload": random.describe(), "params": repr(fixed_length_params(switch_output_len)),
            "completion_tokens_per_s": per_mode, "ratios": ratios, "median_ratio": statistics.median(ratios)}


def format_copy_report(result: dict) -> str:
    lines = [f"batchgen bench --workload copy: k = {result['num_speculative_tokens']}, draft "
             f"{result['draft_model']} ({result['draft_quantization'] or 'unquantized'}), max_tokens "
             f"{result['max_tokens']}", "",
             f"  {'run':<24} {'tok/s':>8} {'vs off':>7} {'identical':>10} {'accept':>7} {'mean len':>9}"]
    for name, r in result["runs"].items():
        same = r.get("identical_to_off")
        lines.append(f"  {name:<24} {r['completion_tokens_per_s']:>8.1f} {r.get('speedup_vs_off', 1.0):>6.2f}x "
                     f"{(str(same['num_exact']) + '/' + str(same['num_requests'])) if same else '-':>10} "
                     f"{r['acceptance_rate'] if r.get('acceptance_rate') is not None else float('nan'):>7.2f} "
                     f"{r['mean_accepted_length'] if r.get('mean_accepted_length') is not None else float('nan'):>9.2f}")
    peer = result["peer"]
    if peer:
        for key in ("plain", "prompt_lookup"):
            p = peer[key]
            lines.append(f"  {p['name']:<24} {p['completion_tokens_per_s']:>8.1f} (batch 1; identical to "
                         f"engine off: {p['identical_to_engine_off']['num_exact']}/"
                         f"{p['identical_to_engine_off']['num_requests']})")
        lines.append(f"  ngram / HF prompt lookup at batch 1: {peer['ngram_vs_hf_prompt_lookup']:.2f}x; "
                     f"HF prompt lookup / HF plain: {peer['hf_prompt_lookup_vs_hf_plain']:.2f}x")
    s = result["batch_switch"]
    if s:
        lines.append(f"  random workload, batch 64, ngram configured (default switch) / off: ratios "
                     f"{', '.join(f'{r:.3f}' for r in s['ratios'])}, median {s['median_ratio']:.3f}")
    busy = result["machine"].get("cpu_busy_before")
    if busy is not None and busy > 0.25:
        lines.append(f"  WARNING: {busy:.0%} of the CPUs were busy with other work just before the run")
    return "\n".join(lines)
