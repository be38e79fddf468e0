"""The engine side of the bench: build an LLMEngine for the comparison and time one workload pass."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import yaml

from batchgen.bench.result import TimedRun
from batchgen.bench.workloads import Workload
from batchgen.engine import EngineConfig, LLMEngine, SamplingParams

# The comparison runs on the CPU, the peer in the engine's dtype: these are set by the bench's own flags.
FIXED_ENGINE_KEYS = {"model": "--model", "dtype": "--dtype", "device": "cpu", "num_threads": "--threads"}


def parse_engine_overrides(items: list[str] | None) -> dict:
    """['max_num_seqs=64', 'enable_prefix_caching=false'] -> typed EngineConfig keywords."""
    allowed = {f.name for f in dataclasses.fields(EngineConfig)} - set(FIXED_ENGINE_KEYS)
    overrides: dict = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--engine takes KEY=VALUE, got {item!r}")
        if key in FIXED_ENGINE_KEYS:
            raise ValueError(f"--engine {key} is fixed by the bench (set by {FIXED_ENGINE_KEYS[key]})")
        if key not in allowed:
            raise ValueError(f"--engine {key}: unknown engine key; known: {', '.join(sorted(allowed))}")
        overrides[key] = yaml.safe_load(raw) if raw.strip() else None
    return overrides


def build_engine(model: str, num_threads: int | None, overrides: dict, dtype: str = "float32") -> LLMEngine:
    """A CPU engine in `dtype` (float32 | bfloat16 | auto) with the job defaults plus `overrides`
    (EngineConfig validates the values)."""
    config = EngineConfig(model=model, dtype=dtype, device="cpu", num_threads=num_threads, **overrides)
    return LLMEngine(config)


def fixed_length_params(output_len: int) -> SamplingParams:
    """Greedy with exactly output_len tokens: EOS is masked below min_tokens, as the peer's
    min_new_tokens masks it, so both pick the same token where EOS would have been the argmax."""
    return SamplingParams(temperature=0.0, max_tokens=output_len, min_tokens=output_len, ignore_eos=True)


def run_engine(engine: LLMEngine, workload: Workload, name: str = "engine",
               params_for: Callable[[int], SamplingParams] = fixed_length_params) -> TimedRun:
    """Time add_request for every prompt (token ids: no tokenizing) through the last step.
    `params_for(output_len)`: each request's SamplingParams (default: greedy, exactly output_len tokens)."""
    params = {n: params_for(n) for n in set(workload.output_lens)}
    before = engine.stats
    outputs = {}
    start = time.perf_counter()
    for r in workload.requests:
        engine.add_request(r.request_id, None, params[r.output_len], prompt_token_ids=r.prompt_token_ids)
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out
    seconds = time.perf_counter() - start
    after = engine.stats
    stats = {k: after[k] - before[k] for k in after
             if k.startswith("num_") and k not in ("num_free_blocks", "num_blocks")}
    finish_reasons: dict[str, int] = {}
    for out in outputs.values():
        for completion in out.outputs:
            finish_reasons[completion.finish_reason] = finish_reasons.get(completion.finish_reason, 0) + 1
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs.values())
    token_ids = {rid: list(o.outputs[0].token_ids) for rid, o in outputs.items()}
    cfg = engine.config
    details = {
        "stats": stats,
        "prefix_cache_hit_rate": stats["num_cached_tokens"] / prompt_tokens if prompt_tokens else 0.0,
        "finish_reasons": finish_reasons,
        "config": {"max_num_seqs": cfg.max_num_seqs, "max_num_batched_tokens": cfg.max_num_batched_tokens,
                   "enable_prefix_caching": cfg.enable_prefix_caching, "compile": cfg.compile,
                   "attention_backend": engine.capabilities.attention_backend, "num_kv_blocks": engine.num_kv_blocks},
    }
    return TimedRun(name, prompt_tokens, sum(len(t) for t in token_ids.values()), seconds, token_ids, details)
