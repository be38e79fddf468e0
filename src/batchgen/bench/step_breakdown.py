"""Where an engine run's time goes, per dtype: linear layers, attention, elementwise ops, the rest of
the forward (embedding, logits rows, sampler) and host work, for prefill-carrying and decode-only
steps apart, over the random workload. Dtypes run interleaved, round after round, each round on a
fresh engine over the already-loaded weights, so a busy neighbour hits every dtype alike.

    python -m batchgen.bench.step_breakdown --dtype float32,bfloat16 --rounds 3 --threads 2

Timers wrap each linear module, the attention backend and the elementwise ops (they add a few
microseconds per call: compare dtypes with each other, not with `batchgen bench`). To see another
instruction set, start the process under BATCHGEN_CPU_ISA (kernels/cpu_isa.py), e.g.
`BATCHGEN_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from types import SimpleNamespace

import torch
from torch import nn

from batchgen.bench.engine_side import fixed_length_params
from batchgen.bench.machine import machine_fingerprint
from batchgen.bench.workloads import random_workload, special_token_ids
from batchgen.engine import EngineConfig, LLMEngine
from batchgen.engine.runner.cpu_allocator import keep_freed_memory

PARTS = ("linear", "attention", "elementwise", "forward_other", "host")


class _Clock:
    """Seconds per part for the step under way (`current`), booked to its kind once it is known."""

    def __init__(self):
        self.current: dict[str, float] = defaultdict(float)
        self.seconds: dict[str, dict[str, float]] = {k: defaultdict(float) for k in ("prefill", "decode")}

    def timed(self, part: str, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[part] += time.perf_counter() - start
        return wrapper

    def book(self, kind: str) -> None:
        for part, seconds in self.current.items():
            self.seconds[kind][part] += seconds
        self.current.clear()


def _instrument(engine: LLMEngine, clock: _Clock) -> None:
    model = engine.runner.model
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.forward = clock.timed("linear", module.forward)
    model.backend.forward = clock.timed("attention", model.backend.forward)
    model.ops = SimpleNamespace(**{name: clock.timed("elementwise", fn) for name, fn in vars(model.ops).items()})


def _uninstrument(engine: LLMEngine) -> None:
    model = engine.runner.model
    for module in model.modules():
        module.__dict__.pop("forward", None)
    model.backend.__dict__.pop("forward", None)


def run_once(base: LLMEngine, workload) -> dict:
    """One pass of `workload` through a fresh engine over base's weights, with the part timers."""
    engine = LLMEngine(base.config, weights_from=base)
    clock = _Clock()
    ops = engine.runner.model.ops
    _instrument(engine, clock)
    params = {n: fixed_length_params(n) for n in set(workload.output_lens)}
    for r in workload.requests:
        engine.add_request(r.request_id, None, params[r.output_len], prompt_token_ids=r.prompt_token_ids)
    steps = {"prefill": [0, 0.0, 0.0], "decode": [0, 0.0, 0.0]}  # count, wall seconds, forward seconds
    start = time.perf_counter()
    try:
        while engine.has_unfinished():
            forward_before, prefill_before = engine.timings.forward, engine.scheduler.stats.num_prefill_tokens
            t0 = time.perf_counter()
            engine.step()
            kind = "prefill" if engine.scheduler.stats.num_prefill_tokens > prefill_before else "decode"
            clock.book(kind)
            entry = steps[kind]
            entry[0] += 1
            entry[1] += time.perf_counter() - t0
            entry[2] += engine.timings.forward - forward_before
    finally:
        _uninstrument(engine)
        engine.runner.model.ops = ops
    seconds = time.perf_counter() - start
    result = {"seconds": seconds, "completion_tokens_per_s": workload.num_completion_tokens / seconds}
    for kind, (count, wall, forward) in steps.items():
        parts = dict(clock.seconds[kind])
        measured = sum(parts.get(p, 0.0) for p in ("linear", "attention", "elementwise"))
        parts["forward_other"] = forward - measured
        parts["host"] = wall - forward
        result[kind] = {"num_steps": count, "seconds": wall, **{p: parts.get(p, 0.0) for p in PARTS}}
    return result


def run_breakdown(dtypes: list[str], num_rounds: int, num_requests: int, num_threads: int | None,
                  model: str = "smollm2-135m-instruct", seed: int = 0, kv_cache_memory: str = "1GiB") -> dict:
    if num_threads:
        torch.set_num_threads(num_threads)
    keep_freed_memory()
    # One engine per dtype at once: a KV pool each, sized for the workload rather than the 4 GiB default.
    engines = {d: LLMEngine(EngineConfig(model=model, dtype=d, device="cpu", num_threads=num_threads,
                                         kv_cache_memory=kv_cache_memory)) for d in dtypes}
    first = engines[dtypes[0]]
    workload = random_workload(num_requests, 100, 200, 64, seed, first.model_cfg.vocab_size,
                               special_token_ids(first.tokenizer.hf))
    warm = random_workload(4, 16, 48, 4, seed + 7919, first.model_cfg.vocab_size, special_token_ids(first.tokenizer.hf))
    for engine in engines.values():
        run_once(engine, warm)
    runs: dict[str, list[dict]] = {d: [] for d in dtypes}
    for round_index in range(num_rounds):
        for d in dtypes:
            runs[d].append(run_once(engines[d], workload))
            print(f"[breakdown] round {round_index + 1} {d}: {runs[d][-1]['completion_tokens_per_s']:.1f} tok/s",
                  flush=True)
    summary = {}
    for d, results in runs.items():
        best = min(results, key=lambda r: r["seconds"])  # the round least disturbed
        summary[d] = {"kernels": engines[d].capabilities.as_dict(),
                      "completion_tokens_per_s": [r["completion_tokens_per_s"] for r in results],
                      "median_completion_tokens_per_s": statistics.median(r["completion_tokens_per_s"] for r in results),
                      "best_round": best}
    return {"workload": workload.describe(), "machine": machine_fingerprint(), "rounds": num_rounds, "dtypes": summary}


def format_breakdown(result: dict) -> str:
    lines = [(f"random workload, {result['workload']['num_requests']} requests; best of {result['rounds']} "
              "interleaved rounds; seconds per part")]
    for d, s in result["dtypes"].items():
        k = s["kernels"]
        lines.append(f"{d} ({k.get('bf16_path') or 'float32'}, ISA {k.get('cpu_isa')}): median "
                     f"{s['median_completion_tokens_per_s']:.1f} tok/s "
                     f"({', '.join(f'{x:.1f}' for x in s['completion_tokens_per_s'])})")
        for kind in ("prefill", "decode"):
            part = s["best_round"][kind]
            n = max(part["num_steps"], 1)
            cells = "  ".join(f"{p} {part[p]:.2f}" for p in PARTS)
            lines.append(f"  {kind:<7} {part['num_steps']:>3} steps {part['seconds']:6.2f} s "
                         f"({1e3 * part['seconds'] / n:6.1f} ms/step): {cells}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32,bfloat16", help="comma-separated dtypes, run interleaved")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--kv-cache-memory", default="1GiB", help="each engine's KV pool")
    parser.add_argument("--output", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    result = run_breakdown([d for d in args.dtype.split(",") if d], args.rounds, args.num_requests, args.threads,
                           kv_cache_memory=args.kv_cache_memory)
    text = json.dumps(result, indent=2)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    print(format_breakdown(result))


if __name__ == "__main__":
    main()
