"""`batchgen bench --workload reward`: (prompt, completion) pairs scored by a reward model, the engine
against HF transformers' batched forward of the same `*ForSequenceClassification` model.

The model: `--model` when it is a sequence classifier's folder; otherwise that model's decoder (the
bundled SmolLM2-135M by default) with a seeded random score head (one label), saved as
`LlamaForSequenceClassification` (or the family's class) in a temporary folder: the compute of a reward
model of that size, whatever its scores mean.

The workload: `num_requests` prompts (default 250) of random non-special tokens, lengths in
[input_len_min, input_len_max], each with NUM_COMPLETIONS completions of random lengths in
[output_len / 2, output_len] (default 1,000 pairs), seeded. Sides, each on a fresh pool:
- engine: every pair as a pooling request, queued in prefix order (LLM.reward's), so a prompt's
  completions find its blocks in the prefix cache: the hit rate is reported;
- engine, no prefix cache: the same without sharing (what the sharing gives);
- peer: HF's forward over right-padded batches of `peer_batch_size` pairs, sorted by length first (its
  best case: the least padding), the logits at each row's last token read as HF's pooling does.
The figure: pairs per second of each, the engine over the peer, and the rewards' largest difference.
"""

from __future__ import annotations

import gc
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from batchgen.bench.machine import cpu_busy_fraction, machine_fingerprint
from batchgen.engine import LLMEngine
from batchgen.engine.config import EngineConfig
from batchgen.engine.pooling.llm_methods import prefix_order

NUM_COMPLETIONS = 4
DEFAULT_NUM_PROMPTS = 250
PEER_BATCH_SIZE = 16


def reward_workload(num_prompts: int, input_len_min: int, input_len_max: int, output_len: int, seed: int,
                    vocab_size: int, excluded: set[int]) -> list[list[int]]:
    """The pairs' token ids, a prompt's NUM_COMPLETIONS pairs side by side (each prompt + completion)."""
    rng = random.Random(seed)
    allowed = [t for t in range(vocab_size) if t not in excluded]
    pairs = []
    for _ in range(num_prompts):
        prompt = rng.choices(allowed, k=rng.randint(input_len_min, input_len_max))
        pairs.extend(prompt + rng.choices(allowed, k=rng.randint(max(1, output_len // 2), output_len))
                     for _ in range(NUM_COMPLETIONS))
    return pairs


def classifier_folder(model: str, seed: int, say: Callable[[str], None]) -> str:
    """`model` if it is a sequence classifier; else its decoder with a seeded random score head, saved as
    its family's `*ForSequenceClassification` in a temporary folder (transformers writes it)."""
    import transformers

    from batchgen.engine.loader.source import resolve_model
    from batchgen.engine.models.registry import is_classifier
    from batchgen.pipeline.capacity_plan import read_model

    model_cfg, _, _ = read_model(model, None)
    if is_classifier(model_cfg.architecture):
        return model
    folder = Path(tempfile.gettempdir()) / f"batchgen-bench-reward-{Path(model).name}-{seed}"
    if (folder / "config.json").exists():  # made by an earlier run: the same weights and head
        return str(folder)
    source = resolve_model(model)
    kwargs = {"gguf_file": source.gguf_file} if source.is_gguf else {}
    say(f"making a reward model of {model}'s decoder and a random score head")
    causal = transformers.AutoModelForCausalLM.from_pretrained(str(source.folder), dtype=torch.float32, **kwargs)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(source.folder), **kwargs)
    config = causal.config
    config.num_labels = 1
    config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else config.eos_token_id
    name = model_cfg.architecture.replace("ForCausalLM", "ForSequenceClassification")
    config.architectures = [name]
    if hasattr(config, "quantization_config"):  # a GGUF's, dequantized at load: the folder is float32
        del config.quantization_config
    torch.manual_seed(seed)
    classifier = getattr(transformers, name)(config).float().eval()
    classifier.model.load_state_dict(causal.model.state_dict())
    torch.nn.init.normal_(classifier.score.weight, std=config.hidden_size ** -0.5)
    staging = Path(tempfile.mkdtemp(prefix=folder.name + "-", dir=folder.parent))
    classifier.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    staging.rename(folder)  # whole or not at all
    del causal, classifier
    gc.collect()
    return str(folder)


def run_engine_side(engine: LLMEngine, pairs: list[list[int]], enable_prefix_caching: bool) -> tuple[list, float, dict]:
    """(rewards in pair order, seconds, counters) over a fresh pool on the same weights."""
    gc.collect()
    fresh = LLMEngine(engine.config.replace(enable_prefix_caching=enable_prefix_caching), weights_from=engine)
    start = time.perf_counter()
    for i in prefix_order(pairs):
        fresh.add_pooling_request(str(i), pairs[i])
    outputs = {}
    while fresh.has_unfinished():
        for out in fresh.step():
            outputs[out.request_id] = out
    seconds = time.perf_counter() - start
    stats = fresh.stats
    rewards = [outputs[str(i)].outputs.data[0].item() for i in range(len(pairs))]
    return rewards, seconds, {"prefix_cache_hit_rate": stats["prefix_cache_hit_rate"],
                              "num_prefill_tokens": stats["num_prefill_tokens"],
                              "num_cached_tokens": stats["num_cached_tokens"], "num_steps": stats["num_steps"]}


@torch.no_grad()
def run_peer(hf_model, pairs: list[list[int]], pad_token_id: int, batch_size: int) -> tuple[list, float]:
    """HF's forward over right-padded batches (sorted by length), each row's logits at its last token."""
    order = sorted(range(len(pairs)), key=lambda i: len(pairs[i]))
    rewards = [0.0] * len(pairs)
    start = time.perf_counter()
    for first in range(0, len(order), batch_size):
        rows = order[first:first + batch_size]
        width = max(len(pairs[i]) for i in rows)
        ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(rows):
            ids[r, :len(pairs[i])] = torch.tensor(pairs[i])
            mask[r, :len(pairs[i])] = 1
        logits = hf_model(ids, attention_mask=mask).logits  # (B, 1): HF pools the last non-pad token
        for r, i in enumerate(rows):
            rewards[i] = logits[r, 0].item()
    return rewards, time.perf_counter() - start


def run_reward_bench(model: str, *, num_prompts: int, input_len_min: int, input_len_max: int, output_len: int,
                     seed: int, num_threads: int | None, is_peer: bool, overrides: dict,
                     say: Callable[[str], None]) -> dict:
    busy_before = cpu_busy_fraction()
    if num_threads:
        torch.set_num_threads(num_threads)
    folder = classifier_folder(model, seed, say)
    say(f"loading the engine ({folder})")
    config = EngineConfig(model=folder, dtype="float32", device="cpu", num_threads=num_threads,
                          **{"kv_cache_memory": "1GiB", **overrides})
    engine = LLMEngine(config)
    if not engine.is_pooling:
        raise ValueError(f"{folder} did not load as a sequence classifier")
    from batchgen.bench.workloads import special_token_ids

    pairs = reward_workload(num_prompts, input_len_min, input_len_max, output_len, seed,
                            engine.model_cfg.vocab_size, special_token_ids(engine.tokenizer.hf))
    pairs = [ids for ids in pairs if len(ids) <= engine.max_model_len]
    run_engine_side(engine, pairs[:8], True)  # warm-up, untimed
    say(f"engine: {len(pairs)} pairs, prefix cache on")
    rewards, seconds, stats = run_engine_side(engine, pairs, True)
    say("engine: prefix cache off")
    _, unshared_s, unshared = run_engine_side(engine, pairs, False)
    num_tokens = sum(map(len, pairs))
    result = {
        "workload": {"name": "reward", "model": model, "reward_model": folder, "num_prompts": num_prompts,
                     "num_completions": NUM_COMPLETIONS, "num_pairs": len(pairs), "num_tokens": num_tokens,
                     "prompt_len_min": input_len_min, "prompt_len_max": input_len_max,
                     "completion_len_max": output_len, "seed": seed},
        "engine": {"seconds": seconds, "pairs_per_s": len(pairs) / seconds, **stats,
                   "unshared_seconds": unshared_s, "unshared_pairs_per_s": len(pairs) / unshared_s,
                   "unshared_num_prefill_tokens": unshared["num_prefill_tokens"]},
        "machine": {**machine_fingerprint(), "cpu_busy_before": busy_before},
    }
    if is_peer:
        from transformers import AutoModelForSequenceClassification

        say("peer: HF transformers' batched forward")
        hf_model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32,
                                                                      attn_implementation="sdpa").eval()
        pad = hf_model.config.pad_token_id
        run_peer(hf_model, pairs[:8], pad, PEER_BATCH_SIZE)  # warm-up, untimed
        peer_rewards, peer_s = run_peer(hf_model, pairs, pad, PEER_BATCH_SIZE)
        result["peer"] = {"seconds": peer_s, "pairs_per_s": len(pairs) / peer_s, "batch_size": PEER_BATCH_SIZE,
                          "engine_over_peer": peer_s / seconds,
                          "max_abs_reward_diff": max(abs(a - b) for a, b in zip(rewards, peer_rewards))}
    return result


def format_reward_report(result: dict) -> str:
    w, e = result["workload"], result["engine"]
    lines = [f"reward: {w['num_pairs']} pairs ({w['num_prompts']} prompts of {w['prompt_len_min']}-"
             f"{w['prompt_len_max']} tokens x {w['num_completions']} completions of <= {w['completion_len_max']}),"
             f" {w['num_tokens']:,} tokens, model {w['reward_model']}",
             f"  batchgen                 {e['pairs_per_s']:8.1f} pairs/s  ({e['seconds']:.2f} s; prefix-cache hit rate "
             f"{e['prefix_cache_hit_rate']:.1%}, {e['num_prefill_tokens']:,} tokens computed)",
             f"  batchgen, no prefix cache {e['unshared_pairs_per_s']:7.1f} pairs/s  ({e['unshared_seconds']:.2f} s)"]
    if "peer" in result:
        p = result["peer"]
        lines.append(f"  HF forward (batch {p['batch_size']:>2})     {p['pairs_per_s']:8.1f} pairs/s  ({p['seconds']:.2f} s)")
        lines.append(f"  batchgen / HF            {p['engine_over_peer']:8.2f}x   max |reward difference| "
                     f"{p['max_abs_reward_diff']:.2e}")
    return "\n".join(lines)
