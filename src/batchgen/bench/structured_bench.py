"""`batchgen bench --structured-schema FILE`: the workload with a JSON schema on every request against
the same workload unconstrained, interleaved runs, and the ratio of their throughputs.

Each run is a fresh engine over the loaded weights (empty KV pool and prefix cache); the runs
alternate unconstrained, constrained, unconstrained, ... so a machine that slows down or speeds up
affects both sides alike. Both sides are greedy with max_tokens = the workload's output length; the
unconstrained side also ignores EOS (the workload's fixed length), the constrained side ends where
its grammar does (EOS), so for a like-for-like figure use a schema whose outputs are longer than the
output length (benchmark-results/schemas/records.json asks for 32 items or more: every output is cut at
output_len, finish_reason length). The grammar is compiled (and the grammar library's tokenizer view
built) before the first timed run. The constrained runs report the token mask's host time per step
(fill, copy, apply) and the constrained rows per step from the engine's counters.
"""

from __future__ import annotations

import gc
import json
import statistics
from collections.abc import Callable
from pathlib import Path

from batchgen.bench.engine_side import fixed_length_params, run_engine
from batchgen.bench.workloads import Workload
from batchgen.engine import LLMEngine, SamplingParams
from batchgen.engine.decoding.structured import StructuredOutputsParams


def read_schema(path: str | Path) -> dict:
    """The JSON schema in `path`; ValueError naming the file when it is not one."""
    try:
        schema = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"--structured-schema: {path} not found") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"--structured-schema: {path} is not a readable JSON file: {exc}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"--structured-schema: {path} must hold a JSON schema object")
    return schema


def run_structured_comparison(engine: LLMEngine, workload: Workload, schema_path: str, num_runs: int,
                              say: Callable[[str], None]) -> dict:
    """`num_runs` interleaved pairs (unconstrained, constrained) over `workload`; the result dict."""
    schema = read_schema(schema_path)
    constraint = StructuredOutputsParams(json=schema)
    engine.compile_grammar(constraint)  # the library's tokenizer view and the grammar, outside the timing

    def constrained(output_len: int) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=output_len, structured_outputs=constraint)

    sides = {"unconstrained": fixed_length_params, "structured": constrained}
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    warmup = Workload("warmup", workload.requests[:4], {})
    for params_for in sides.values():  # first-use kernels and allocations, both sides
        run_engine(engine, warmup, "warmup", params_for)
    # Each run's pool holds the whole workload at once (no preemption) and no more: a fresh pool per
    # run beside the loaded engine's own.
    block_size = engine.config.block_size
    num_blocks = max(sum(-(-(len(r.prompt_token_ids) + r.output_len) // block_size) for r in workload.requests),
                     -(-engine.max_model_len // block_size))
    config = engine.config.replace(num_kv_blocks=num_blocks, max_model_len=engine.max_model_len)
    for i in range(num_runs):
        for name, params_for in sides.items():
            fresh = LLMEngine(config, weights_from=engine)
            timed = run_engine(fresh, workload, name, params_for)
            entry = timed.as_dict()
            entry["structured"] = fresh.stats["structured"]
            runs[name].append(entry)
            del fresh  # one fresh KV pool at a time
            gc.collect()
            say(f"run {i + 1}/{num_runs} {name}: {timed.completion_tokens_per_s:.1f} completion tokens/s")
    rates = {name: [r["completion_tokens_per_s"] for r in entries] for name, entries in runs.items()}
    medians = {name: statistics.median(values) for name, values in rates.items()}
    masked = runs["structured"]
    return {
        "structured_schema": str(schema_path),
        "num_runs": num_runs,
        "runs": runs,
        "median_completion_tokens_per_s": medians,
        "ratio": medians["structured"] / medians["unconstrained"],
        "pair_ratios": [s / u for s, u in zip(rates["structured"], rates["unconstrained"])],
        "mask_ms_per_step": statistics.median(r["structured"]["mask_ms_per_step"] for r in masked),
        "fill_ms_per_step": statistics.median(1000 * r["structured"]["fill_seconds"]
                                              / max(r["structured"]["num_masked_steps"], 1) for r in masked),
        "masked_rows_per_step": statistics.median(r["structured"]["masked_rows_per_step"] for r in masked),
        "finish_reasons": {name: entries[0]["finish_reasons"] for name, entries in runs.items()},
    }


def format_structured_report(result: dict) -> str:
    s = result["structured"]
    w = result["workload"]
    lines = [f"batchgen bench: workload {w['name']}: {w['num_requests']} requests, output {w.get('output_len', '?')} "
             f"tokens; every request constrained by {s['structured_schema']} vs none, {s['num_runs']} interleaved runs",
             f"  {'run':<5} {'unconstrained tok/s':>20} {'structured tok/s':>17} {'ratio':>7} {'mask ms/step':>13}"]
    for i, (u, c) in enumerate(zip(s["runs"]["unconstrained"], s["runs"]["structured"])):
        lines.append(f"  {i + 1:<5} {u['completion_tokens_per_s']:>20.1f} {c['completion_tokens_per_s']:>17.1f} "
                     f"{s['pair_ratios'][i]:>7.3f} {c['structured']['mask_ms_per_step']:>13.2f}")
    med = s["median_completion_tokens_per_s"]
    lines += [f"  {'median':<5} {med['unconstrained']:>20.1f} {med['structured']:>17.1f} {s['ratio']:>7.3f} "
              f"{s['mask_ms_per_step']:>13.2f}",
              f"  constrained rows per masked step: {s['masked_rows_per_step']:.1f}; of the mask time, the host "
              f"fill {s['fill_ms_per_step']:.2f} ms",
              f"  finish reasons: {s['finish_reasons']}"]
    return "\n".join(lines)
