"""The job's figures: counted from the output tables themselves, so `_SUCCESS` always agrees with the rows."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

SUCCESS_KEYS = ("job", "config_hash", "model", "generation_config", "num_requests", "num_rows", "num_errors", "prompt_tokens",
                "cached_tokens", "completion_tokens", "generation_seconds", "completion_tokens_per_s",
                "ttft_s", "tpot_s", "resumed", "kernels", "kv_cache", "weights", "workers", "speculative",
                "structured")
SUMMARY_COLUMNS = ["sample_index", "finish_reason", "prompt_tokens", "cached_tokens", "completion_tokens",
                   "ttft_s", "tpot_s"]


def _sum(array: pa.ChunkedArray) -> int:
    return int(pc.sum(array).as_py() or 0)


@dataclass
class Totals:
    """Counts over output tables. A request is its sample_index 0 row (every request has n rows)."""

    num_requests: int = 0
    num_rows: int = 0
    num_errors: int = 0  # requests that failed (each wrote n error rows)
    prompt_tokens: int = 0  # over requests
    cached_tokens: int = 0  # over requests
    completion_tokens: int = 0  # over rows
    ttft_s: list[np.ndarray] = field(default_factory=list)
    tpot_s: list[np.ndarray] = field(default_factory=list)

    def add_table(self, table: pa.Table) -> None:
        first = table.filter(pc.equal(table["sample_index"], 0))
        self.num_requests += first.num_rows
        self.num_rows += table.num_rows
        self.num_errors += _sum(pc.cast(pc.equal(first["finish_reason"], "error"), pa.int64()))
        self.prompt_tokens += _sum(first["prompt_tokens"])
        self.cached_tokens += _sum(first["cached_tokens"])
        self.completion_tokens += _sum(table["completion_tokens"])
        for name in ("ttft_s", "tpot_s"):  # a loglikelihood job's rows have no token times
            if name in table.column_names:
                getattr(self, name).append(table[name].drop_null().to_numpy())


def read_summary_table(f) -> pa.Table:
    """The columns Totals counts, of an open part file (a loglikelihood job's parts have no token times)."""
    names = pq.read_schema(f).names
    f.seek(0)
    return pq.read_table(f, columns=[c for c in SUMMARY_COLUMNS if c in names])


def percentiles(chunks: list[np.ndarray]) -> dict[str, float | None]:
    values = np.concatenate(chunks) if chunks else np.array([])
    if values.size == 0:
        return {"p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99)}


def success_record(job: str, config_hash: str, whole: Totals, this_run: Totals, generation_seconds: float,
                   resumed: bool, kernels: dict, kv_cache: dict | None = None, weights: dict | None = None,
                   workers: dict | None = None, speculative: dict | None = None, model: str | None = None,
                   generation_config: dict | None = None, structured: dict | None = None) -> dict:
    """The `_SUCCESS` JSON: counts over the whole output; speed and latency figures over this run;
    `kernels`: the implementations this run's engine used (its stats' `kernels`); `kv_cache`: its KV
    cache's dtype and bytes per token (its stats' `kv_cache`); `weights`: its weight format and linear
    bytes (its stats' `weights`); `workers`: how the job ran (`{"backend": "local"}`, static shards, or
    Ray replicas with their failures); `speculative`: this run's draft and accepted tokens
    (`speculative_summary`), null when speculation is off; `model`: the model path the engine loaded (as
    the job names it), so a report can tell whether two runs share a tokenizer; `generation_config`: the
    job's model.generation_config, the file it read and the sampling defaults it gave the job
    (`{"setting", "file", "applied"}`); `structured`: this run's constrained requests and the token
    mask's time per step (`structured_summary`), null when no request was constrained."""
    record = {
        "job": job,
        "config_hash": config_hash,
        "model": model,
        "generation_config": generation_config,
        "num_requests": whole.num_requests,
        "num_rows": whole.num_rows,
        "num_errors": whole.num_errors,
        "prompt_tokens": whole.prompt_tokens,
        "cached_tokens": whole.cached_tokens,
        "completion_tokens": whole.completion_tokens,
        "generation_seconds": generation_seconds,
        "completion_tokens_per_s": this_run.completion_tokens / generation_seconds if generation_seconds > 0 else 0.0,
        "ttft_s": percentiles(this_run.ttft_s),
        "tpot_s": percentiles(this_run.tpot_s),
        "resumed": resumed,
        "kernels": kernels,
        "kv_cache": kv_cache or {},
        "weights": weights or {},
        "workers": workers if workers is not None else local_workers(),
        "speculative": speculative,
        "structured": structured,
    }
    assert tuple(record) == SUCCESS_KEYS
    return record


def speculative_summary(before: dict | None, after: dict | None) -> dict | None:
    """Draft and accepted tokens between two engine `stats["speculative"]` readings, with the
    acceptance rate (accepted / drafted) and the mean accepted length (tokens emitted per verify,
    the target's own included: vLLM's definition). None: speculation off."""
    if after is None:
        return None
    before = before or {}
    drafted, accepted, verifies = (after[k] - before.get(k, 0)
                                   for k in ("num_draft_tokens", "num_accepted_tokens", "num_verifies"))
    return _with_rates(drafted, accepted, verifies)


def merge_speculative(parts: list[dict | None]) -> dict | None:
    """Several workers' `speculative_summary` figures as one (their counts summed, rates recomputed);
    None when none of them speculated (speculation off: every part None)."""
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    drafted, accepted, verifies = (sum(p[k] for p in parts)
                                   for k in ("num_draft_tokens", "num_accepted_tokens", "num_verifies"))
    return _with_rates(drafted, accepted, verifies)


def _with_rates(drafted: int, accepted: int, verifies: int) -> dict:
    return {"num_draft_tokens": drafted, "num_accepted_tokens": accepted, "num_verifies": verifies,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_length": 1 + accepted / verifies if verifies else None}


_STRUCTURED_COUNTS = ("num_constrained_requests", "num_masked_steps", "num_masked_rows", "mask_seconds",
                      "num_compiles", "compile_seconds")


def structured_summary(before: dict | None, after: dict | None) -> dict | None:
    """Constrained requests, grammar compiles and the per-step token mask between two engine
    `stats["structured"]` readings, with the mask's host time per masked step (fill, copy, apply) and
    the constrained rows per masked step. None: no request was constrained."""
    if after is None:
        return None
    before = before or {}
    counts = {k: after[k] - before.get(k, 0) for k in _STRUCTURED_COUNTS}
    return _with_mask_rates(counts) if counts["num_constrained_requests"] else None


def merge_structured(parts: list[dict | None]) -> dict | None:
    """Several workers' `structured_summary` figures as one (counts summed, rates recomputed)."""
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    return _with_mask_rates({k: sum(p[k] for p in parts) for k in _STRUCTURED_COUNTS})


def _with_mask_rates(counts: dict) -> dict:
    steps = counts["num_masked_steps"]
    return {**counts, "mask_ms_per_step": 1000 * counts["mask_seconds"] / steps if steps else None,
            "masked_rows_per_step": counts["num_masked_rows"] / steps if steps else None}


def _structured_line(structured: dict | None) -> str:
    if not structured:
        return "-"
    ms = structured["mask_ms_per_step"]
    return (f"{structured['num_constrained_requests']:,} constrained requests; token mask "
            + (f"{ms:.2f} ms per step ({structured['masked_rows_per_step']:.1f} rows)" if ms is not None else "-"))


def _speculative_line(spec: dict | None) -> str:
    if not spec:
        return "off"
    if not spec["num_draft_tokens"]:
        return "no drafts"
    return (f"{spec['num_accepted_tokens']:,} of {spec['num_draft_tokens']:,} draft tokens accepted "
            f"({spec['acceptance_rate']:.0%}), {spec['mean_accepted_length']:.2f} tokens per verify")


def local_workers() -> dict:
    return {"backend": "local", "num_workers": 1, "replica_failures": 0, "units_retried": []}


def describe_workers(workers: dict | None) -> str:
    if not workers:
        return "-"
    backend = workers.get("backend")
    if backend == "shards":
        text = f"{workers['num_shards']} static shards"
    elif backend == "ray":
        text = f"ray, {workers['num_workers']} replica(s)"
    else:
        text = "local"
    failures, retried = workers.get("replica_failures", 0), workers.get("units_retried", [])
    if failures or retried:
        text += f"; {failures} replica failure(s), {len(retried)} unit(s) retried"
    return text


def _generation_line(generation: dict | None) -> str:
    if not generation:
        return "-"
    if not generation.get("applied"):
        return f"the job's (generation_config {generation['setting']})"
    shown = ", ".join(f"{k}={v}" for k, v in generation["applied"].items())
    return f"{shown} from {generation['file']} (generation_config {generation['setting']}); the rest the job's"


def _weights_line(weights: dict) -> str:
    if not weights:
        return "-"
    return (f"{weights['format']} ({weights['origin']}), linear layers {weights['linear_bytes'] / 1e6:,.1f} MB "
            f"({weights['linear_bytes_vs_float32']:.1%} of float32)")


def format_summary(record: dict, success_path: str) -> str:
    """The readable table printed at the end of a run."""

    def ms(p: dict) -> str:
        if p["p50"] is None:
            return "-"
        return " / ".join(f"{p[k] * 1000:.1f}" for k in ("p50", "p90", "p99")) + " ms"

    prompt = record["prompt_tokens"]
    hit = f" ({record['cached_tokens'] / prompt:.0%} of prompt tokens)" if prompt else ""
    lines = [
        ("job", f"{record['job']}  (config {record['config_hash'][:12]})"),
        ("model", record.get("model") or "-"),
        ("sampling defaults", _generation_line(record.get("generation_config"))),
        ("requests", f"{record['num_requests']:,}  ({record['num_errors']:,} errors)"),
        ("output rows", f"{record['num_rows']:,}"),
        ("prompt tokens", f"{prompt:,}"),
        ("cached tokens", f"{record['cached_tokens']:,}{hit}"),
        ("completion tokens", f"{record['completion_tokens']:,}"),
        ("generation", f"{record['generation_seconds']:.2f} s, {record['completion_tokens_per_s']:,.1f} completion tok/s"),
        ("TTFT p50/p90/p99", ms(record["ttft_s"])),
        ("TPOT p50/p90/p99", ms(record["tpot_s"])),
        ("resumed", "yes (speed and latency cover this run only)" if record["resumed"] else "no"),
        # A _SUCCESS written by an older batchgen (a complete job run again) has no `kernels`.
        ("kernels", ", ".join(f"{k} {v}" for k, v in record.get("kernels", {}).items()) or "-"),
        ("KV cache", ", ".join(f"{k} {v}" for k, v in record.get("kv_cache", {}).items()) or "-"),
        ("weights", _weights_line(record.get("weights") or {})),
        ("workers", describe_workers(record.get("workers"))),
        ("speculative", _speculative_line(record.get("speculative"))),
        ("structured", _structured_line(record.get("structured"))),
        ("success file", success_path),
    ]
    width = max(len(k) for k, _ in lines)
    return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in lines)
