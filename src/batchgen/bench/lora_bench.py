"""`batchgen bench --workload lora`: LoRA adapters against the base model, at one batch on this machine.

The adapters: four PEFT folders (adapter_config.json + adapter_model.safetensors, as peft saves them)
with seeded random weights over `--model` (the bundled SmolLM2-135M by default), written once to a
temporary folder: A (r 8: q/v/down), B (r 4, rsLoRA: k/o/gate/up), C (r 16: q/k/v/o), D (r 2:
gate/up/down), the ranks and targets of the tests' adapters. Their values do not change the compute.

The workload: `num_requests` prompts (default 64) of random non-special tokens, lengths in
[input_len_min, input_len_max], each decoding `output_len` tokens greedily with EOS ignored, all
queued at once (the running batch is the whole set). Sides, each its own engine, timed in interleaved
rounds (the best round of each is reported, so a busy spell of the shared machine hurts them alike):
- base: the model alone;
- mixed: an enable_lora engine (max_loras 4), the four adapters in turn over the rows, every step
  mixing all four;
- lora engine, base rows: the enable_lora engine with no adapter on any row (the LoRA layers' cost
  when they add nothing);
- merged: adapter A merged into the weights at load (EngineConfig.merged_lora, what a job whose one
  adapter runs every row does).
The figures: tokens per second of each, and each over the base (aims: mixed >= 0.7x, merged >= 0.97x).
"""

from __future__ import annotations

import gc
import json
import math
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from batchgen.bench.machine import cpu_busy_fraction, machine_fingerprint
from batchgen.engine import LLMEngine, SamplingParams
from batchgen.engine.config import EngineConfig
from batchgen.engine.lora import LoRARequest

# name -> (rank, alpha, rsLoRA, HF target modules): tests/lora_adapters.py's adapters.
ADAPTERS = {
    "A": (8, 16, False, ("q_proj", "v_proj", "down_proj")),
    "B": (4, 8, True, ("k_proj", "o_proj", "gate_proj", "up_proj")),
    "C": (16, 8, False, ("q_proj", "k_proj", "v_proj", "o_proj")),
    "D": (2, 4, False, ("gate_proj", "up_proj", "down_proj")),
}
DEFAULT_ROUNDS = 3
MAX_LORA_RANK = 16
SIDES = ("base", "mixed", "lora_engine_base_rows", "merged")


def _module_shapes(model_cfg) -> dict[str, tuple[int, int, str]]:
    """HF module leaf -> (in, out, parent) for a Llama-shaped decoder layer."""
    hidden, inter, q, kv = model_cfg.hidden_size, model_cfg.intermediate_size, model_cfg.q_size, model_cfg.kv_size
    return {"q_proj": (hidden, q, "self_attn"), "k_proj": (hidden, kv, "self_attn"), "v_proj": (hidden, kv, "self_attn"),
            "o_proj": (q, hidden, "self_attn"), "gate_proj": (hidden, inter, "mlp"), "up_proj": (hidden, inter, "mlp"),
            "down_proj": (inter, hidden, "mlp")}


def write_adapters(model_cfg, folder: Path, seed: int) -> dict[str, Path]:
    """The four PEFT folders under `folder` (kept from an earlier run with the same model and seed)."""
    from safetensors.torch import save_file

    shapes = _module_shapes(model_cfg)
    folders = {}
    generator = torch.Generator().manual_seed(seed)
    for name, (rank, alpha, rslora, targets) in ADAPTERS.items():
        out = folder / name
        folders[name] = out
        if (out / "adapter_model.safetensors").exists():
            continue
        tensors = {}
        for layer in range(model_cfg.num_layers):
            for leaf in targets:
                in_features, out_features, parent = shapes[leaf]
                key = f"base_model.model.model.layers.{layer}.{parent}.{leaf}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) / math.sqrt(in_features)
                tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.05
        staging = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=folder))
        save_file(tensors, str(staging / "adapter_model.safetensors"))
        (staging / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "use_rslora": rslora,
            "target_modules": list(targets), "bias": "none", "task_type": "CAUSAL_LM"}))
        staging.rename(out)  # whole or not at all
    return folders


def lora_prompts(num_requests: int, input_len_min: int, input_len_max: int, seed: int, vocab_size: int,
                 excluded: set[int]) -> list[list[int]]:
    rng = random.Random(seed)
    allowed = [t for t in range(vocab_size) if t not in excluded]
    return [rng.choices(allowed, k=rng.randint(input_len_min, input_len_max)) for _ in range(num_requests)]


def run_side(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams,
             loras: list[LoRARequest | None]) -> tuple[float, int]:
    """(seconds, tokens generated) for every prompt queued at once; the engine's pool is empty after."""
    gc.collect()
    start = time.perf_counter()
    for i, (ids, lora) in enumerate(zip(prompts, loras)):
        engine.add_request(f"r{i}", ids, params, lora_request=lora)
    num_tokens = 0
    while engine.has_unfinished():
        for out in engine.step():
            num_tokens += len(out.outputs[0].token_ids)
    return time.perf_counter() - start, num_tokens


def run_lora_bench(model: str, *, num_requests: int, input_len_min: int, input_len_max: int, output_len: int,
                   seed: int, num_threads: int | None, overrides: dict, rounds: int = DEFAULT_ROUNDS,
                   say: Callable[[str], None] = print) -> dict:
    busy_before = cpu_busy_fraction()
    if num_threads:
        torch.set_num_threads(num_threads)
    settings = {"dtype": "float32", "device": "cpu", "num_threads": num_threads, "kv_cache_memory": "512MiB",
                "max_model_len": max(1024, input_len_max + output_len + 1), "max_num_seqs": num_requests,
                **overrides}
    say(f"loading the base engine ({model})")
    base = LLMEngine(EngineConfig(model=model, **settings))
    folder = Path(tempfile.gettempdir()) / f"batchgen-bench-lora-{Path(model).name}-{seed}"
    folder.mkdir(exist_ok=True)
    folders = write_adapters(base.model_cfg, folder, seed)
    requests = [LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(folders.items())]
    say("loading the enable_lora engine and the merged one (adapter A)")
    lora = LLMEngine(EngineConfig(model=model, enable_lora=True, max_loras=len(requests), max_lora_rank=MAX_LORA_RANK,
                                  **settings))
    merged = LLMEngine(EngineConfig(model=model, merged_lora=str(folders["A"]), **settings))
    from batchgen.bench.workloads import special_token_ids

    prompts = lora_prompts(num_requests, input_len_min, input_len_max, seed, base.model_cfg.vocab_size,
                           special_token_ids(base.tokenizer.hf))
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    no_lora = [None] * num_requests
    mixed = [requests[i % len(requests)] for i in range(num_requests)]
    sides = {"base": (base, no_lora), "mixed": (lora, mixed), "lora_engine_base_rows": (lora, no_lora),
             "merged": (merged, no_lora)}
    for engine, loras in sides.values():  # warm-up, untimed (adapters read, kernels primed)
        run_side(engine, prompts[:8], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), loras[:8])
    rates: dict[str, list[float]] = {name: [] for name in SIDES}
    for round_index in range(rounds):
        for name in SIDES:
            engine, loras = sides[name]
            seconds, num_tokens = run_side(engine, prompts, params, loras)
            rates[name].append(num_tokens / seconds)
        say(f"round {round_index + 1}/{rounds}: " + ", ".join(f"{n} {r[-1]:.1f}" for n, r in rates.items()))
    best = {name: max(values) for name, values in rates.items()}
    return {
        "workload": {"name": "lora", "model": model, "num_requests": num_requests, "prompt_len_min": input_len_min,
                     "prompt_len_max": input_len_max, "output_len": output_len, "seed": seed, "rounds": rounds,
                     "adapters": {name: {"rank": r, "lora_alpha": a, "use_rslora": rs, "targets": list(t)}
                                  for name, (r, a, rs, t) in ADAPTERS.items()}, "merged_adapter": "A"},
        "engine": {"tokens_per_s": best, "tokens_per_s_rounds": rates,
                   "over_base": {name: best[name] / best["base"] for name in SIDES if name != "base"},
                   "lora": lora.stats["lora"]},
        "machine": {**machine_fingerprint(), "cpu_busy_before": busy_before},
    }


def format_lora_report(result: dict) -> str:
    w, e = result["workload"], result["engine"]
    labels = {"base": "base model", "mixed": "4 adapters mixed", "lora_engine_base_rows": "LoRA engine, base rows",
              "merged": f"adapter {w['merged_adapter']} merged"}
    lines = [f"lora: {w['num_requests']} requests of {w['prompt_len_min']}-{w['prompt_len_max']} prompt tokens, "
             f"{w['output_len']} tokens each (greedy, EOS ignored), model {w['model']}; best of {w['rounds']} "
             f"interleaved rounds"]
    for name in SIDES:
        ratio = "" if name == "base" else f"   {e['over_base'][name]:.3f}x base"
        rounds = ", ".join(f"{r:.0f}" for r in e["tokens_per_s_rounds"][name])
        lines.append(f"  {labels[name]:<24} {e['tokens_per_s'][name]:8.1f} tok/s{ratio}   (rounds {rounds})")
    busy = result["machine"].get("cpu_busy_before")
    if busy is not None:
        lines.append(f"  machine busy before the run: {busy:.0%} of all CPUs")
    return "\n".join(lines)
