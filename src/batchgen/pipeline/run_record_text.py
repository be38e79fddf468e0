"""The run record as text, in one place: each figure's format and the summary's rows.

`summary_rows` is the one list of what a run record shows (a row per `_SUCCESS` key, in the file's
order, with its label and its text); `format_summary` prints it at the end of `batchgen run`, `batchgen
run --shard` and `batchgen finalize`, and the report's page shows the same rows as its summary table.
The number formats (`count`, `ms`, ...) are the report's too, so a figure reads the same everywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from batchgen.pipeline.run_record import (
    GenerationDefaults,
    MetricFigures,
    Percentiles,
    RunRecord,
    SpeculativeFigures,
    StructuredFigures,
    Workers,
)

NONE = "-"  # an absent figure
# Each number of a run record formatted once, here: the terminal summary and the report's page both
# call these, so a figure reads the same in both.


def count(value: int | None) -> str:
    return NONE if value is None else f"{int(value):,}"


def _milliseconds(seconds: float) -> str:
    return f"{seconds * 1000:,.1f}"


def ms(seconds: float | None) -> str:
    return NONE if seconds is None else f"{_milliseconds(seconds)} ms"


def seconds(value: float | None) -> str:
    return NONE if value is None else f"{value:,.2f} s"


def rate(value: float | None) -> str:
    return NONE if value is None else f"{value:,.1f}"


def share(value: float | None) -> str:
    return NONE if value is None else f"{value:.1%}"


def percentiles(p: Percentiles) -> str:
    """p50 / p90 / p99 in milliseconds; "-" when no row had the figure."""
    if p.p50 is None:
        return NONE
    return " / ".join(_milliseconds(v) for v in (p.p50, p.p90, p.p99)) + " ms"


def pairs(mapping: Mapping | None) -> str:
    """{"device": "cpu", ...} -> "device cpu, ..."."""
    return ", ".join(f"{k} {v}" for k, v in (mapping or {}).items()) or NONE


def weights(w: Mapping | None) -> str:
    """The engine's weights report: format (origin), linear layers' bytes and their share of float32."""
    if not w:
        return NONE
    text = f"{w.get('format', '?')} ({w.get('origin', '?')})"
    if isinstance(w.get("linear_bytes"), (int, float)):
        text += f", linear layers {w['linear_bytes'] / 1e6:,.1f} MB"
    if isinstance(w.get("linear_bytes_vs_float32"), (int, float)):
        text += f" ({share(w['linear_bytes_vs_float32'])} of float32)"
    return text


def workers(w: Workers | None) -> str:
    if w is None:
        return NONE
    if w.backend == "shards":
        text = f"{w.num_shards} static shards"
    elif w.backend == "ray":
        text = f"ray, {w.num_workers} replica(s)"
    else:
        text = "local"
    if w.replica_failures or w.units_retried:
        text += f"; {w.replica_failures} replica failure(s), {len(w.units_retried)} unit(s) retried"
    return text


def speculative(s: SpeculativeFigures | None) -> str:
    if s is None:
        return "off"
    if not s.num_draft_tokens:
        return "no drafts"
    return (f"{s.num_accepted_tokens:,} of {s.num_draft_tokens:,} draft tokens accepted "
            f"({s.acceptance_rate:.0%}), {s.mean_accepted_length:.2f} tokens per verify")


def structured(s: StructuredFigures | None) -> str:
    if s is None:
        return NONE
    mask = (f"{s.mask_ms_per_step:.2f} ms per step ({s.masked_rows_per_step:.1f} rows)"
            if s.mask_ms_per_step is not None else NONE)
    return f"{s.num_constrained_requests:,} constrained requests; token mask {mask}"


def metric_score(m: MetricFigures) -> str:
    """A metric's value with its 95% interval (normal approximation, value +- 1.96 stderr, within the
    verdicts' range 0 to 1) and n."""
    if m.value is None:
        return f"{NONE} (n 0)"
    low, high = max(0.0, m.value - 1.96 * m.stderr), min(1.0, m.value + 1.96 * m.stderr)
    return f"{m.value:.4f} (95% CI {low:.4f} to {high:.4f}, n {m.n:,})"


def metrics(scores: Mapping[str, MetricFigures]) -> str:
    return "; ".join(f"{name} {metric_score(m)}" for name, m in scores.items()) or NONE


def generation_defaults(g: GenerationDefaults | None) -> str:
    if g is None:
        return NONE
    if not g.applied:
        return f"the job's (generation_config {g.setting})"
    shown = ", ".join(f"{k}={v}" for k, v in g.applied.items())
    return f"{shown} from {g.file} (generation_config {g.setting}); the rest the job's"


def cached(record: RunRecord) -> str:
    """Cached prompt tokens and their share of the prompt tokens."""
    hit = f" ({record.cached_tokens / record.prompt_tokens:.0%} of prompt tokens)" if record.prompt_tokens else ""
    return f"{count(record.cached_tokens)}{hit}"


def finish_reasons(record: RunRecord) -> str:
    """Rows by finish_reason with their share: "stop 900 (90.0%), length 100 (10.0%)"."""
    total = sum(record.finish_reasons.values())
    return ", ".join(f"{reason} {count(n)} ({share(n / total)})"
                     for reason, n in record.finish_reasons.items()) if total else NONE


def error_reasons(record: RunRecord) -> str:
    """The top error reasons, a line each: "3 x overlong prompt: N prompt tokens ...", then how many
    failed requests the others account for."""
    if not record.error_reasons:
        return NONE
    lines = [f"{count(n)} x {reason}" for reason, n in record.error_reasons.items()]
    others = record.num_errors - sum(record.error_reasons.values())
    if others > 0:
        lines.append(f"{count(others)} x other reasons")
    return "\n".join(lines)


LENGTH_WARNING_SHARE = 0.25  # above this share of rows cut at max_tokens, the summary warns


def length_warning(record: RunRecord) -> str | None:
    """A warning when more than a quarter of the rows stopped at max_tokens (finish_reason length): their
    answers are likely cut short. None otherwise."""
    num_length, total = record.finish_reasons.get("length", 0), sum(record.finish_reasons.values())
    if not total or num_length <= LENGTH_WARNING_SHARE * total:
        return None
    return (f"warning: {count(num_length)} of {count(total)} rows ({share(num_length / total)}) stopped at max_tokens "
            "(finish_reason length): their answers may be cut short; raise sampling.max_tokens if so")


def provenance(p: Mapping[str, Any]) -> str:
    """The provenance in one line: the version, the model's files, the chat template's hash."""
    if not p:
        return NONE
    files = (p.get("model") or {}).get("files") or {}
    template = p.get("chat_template_sha256")
    return (f"batchgen {p.get('batchgen_version') or '?'}; {len(files)} model file(s) hashed; chat template "
            f"{template[:12] if template else NONE}; every setting in _SUCCESS and each part's metadata")


class SummaryRow(NamedTuple):
    """One line of the end-of-run summary: a _SUCCESS key, its label and its value as text."""

    key: str  # the _SUCCESS key it shows
    label: str
    text: str


def summary_rows(record: RunRecord) -> list[SummaryRow]:
    """What a run record shows, a row per `_SUCCESS` key in the file's order."""
    r = record
    rows = [
        ("job", "job", r.job),
        ("config_hash", "config hash", r.config_hash),
        ("model", "model", r.model or NONE),
        ("generation_config", "sampling defaults", generation_defaults(r.generation_config)),
        ("num_requests", "requests", count(r.num_requests)),
        ("num_rows", "output rows", count(r.num_rows)),
        ("num_errors", "failed requests", count(r.num_errors)),
        ("finish_reasons", "finish reasons", finish_reasons(r)),
        ("error_reasons", "error reasons", error_reasons(r)),
        ("prompt_tokens", "prompt tokens", count(r.prompt_tokens)),
        ("cached_tokens", "cached prompt tokens", cached(r)),
        ("completion_tokens", "completion tokens", count(r.completion_tokens)),
        ("generation_seconds", "generation", seconds(r.generation_seconds)),
        ("completion_tokens_per_s", "completion tokens/s", rate(r.completion_tokens_per_s)),
        ("ttft_s", "TTFT p50/p90/p99", percentiles(r.ttft_s)),
        ("tpot_s", "TPOT p50/p90/p99", percentiles(r.tpot_s)),
        ("resumed", "resumed", "yes (speed and latency cover the last run only)" if r.resumed else "no"),
        ("kernels", "kernels", pairs(r.kernels)),
        ("kv_cache", "KV cache", pairs(r.kv_cache)),
        ("weights", "weights", weights(r.weights)),
        ("workers", "workers", workers(r.workers)),
        ("speculative", "speculative", speculative(r.speculative)),
        ("structured", "structured", structured(r.structured)),
        ("metrics", "metrics", metrics(r.metrics)),
        ("provenance", "provenance", provenance(r.provenance)),
    ]
    return [SummaryRow(*row) for row in rows]


def format_summary(record: RunRecord, success_path: str) -> str:
    """The readable table printed at the end of a run: the summary's rows (a row of several lines, such
    as the error reasons, continues under its first), then where `_SUCCESS` is, then the length warning."""
    rows = [(row.label, row.text) for row in summary_rows(record)] + [("success file", success_path)]
    width = max(len(label) for label, _ in rows)
    lines = []
    for label, text in rows:
        first, *more = text.split("\n")
        lines.append(f"  {label.ljust(width)}  {first}")
        lines.extend(f"  {'':{width}}  {line}" for line in more)
    warning = length_warning(record)
    return "\n".join(lines + ([f"  {warning}"] if warning else []))
