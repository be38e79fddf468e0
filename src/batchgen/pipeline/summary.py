"""The job's figures: counted from the output tables themselves, so `_SUCCESS` always agrees with the rows;
the engine's speculative and structured counters between two readings, and merged over workers."""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchgen.metrics import aggregate, metric_column, metric_fields_of
from batchgen.pipeline.run_record import MetricFigures, SpeculativeFigures, StructuredFigures

SUMMARY_COLUMNS = ["sample_index", "finish_reason", "error", "prompt_tokens", "cached_tokens", "completion_tokens",
                   "ttft_s", "tpot_s"]
NUM_ERROR_REASONS = 5  # the most frequent error reasons a run record keeps
# Distinct reasons a Totals keeps while counting: messages that quote each row's own text would otherwise
# grow it with the rows; past the cap the rarest are dropped (the summary counts them as "other reasons").
MAX_DISTINCT_REASONS = 1000
_NUMBER = re.compile(r"\d+(?:[.,_]\d+)*")
_MAX_REASON_CHARS = 200


def error_reason(message: str | None) -> str:
    """An error row's message as a reason: its numbers masked as N, so that every row's "overlong prompt:
    3,120 prompt tokens + max_tokens 256 > max_model_len 2048" counts as one reason; at most 200 characters."""
    text = _NUMBER.sub("N", " ".join((message or "(no message)").split()))
    return text if len(text) <= _MAX_REASON_CHARS else text[:_MAX_REASON_CHARS - 3] + "..."


def top_counts(counts: dict[str, int], num: int) -> dict[str, int]:
    """The `num` largest counts, largest first (ties in name order, so that a record is reproducible)."""
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:num])


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
    finish_reasons: dict[str, int] = field(default_factory=dict)  # rows by finish_reason
    error_reasons: dict[str, int] = field(default_factory=dict)  # failed requests by error_reason(message)
    ttft_s: list[np.ndarray] = field(default_factory=list)
    tpot_s: list[np.ndarray] = field(default_factory=list)
    # The metrics' verdicts, by metric: how each aggregates (its column's metadata), the verdict chunks
    # and, for pass@k, each row's id (its samples are grouped by id).
    metric_kinds: dict[str, dict] = field(default_factory=dict)
    metric_verdicts: dict[str, list[np.ndarray]] = field(default_factory=dict)
    metric_ids: dict[str, list[list]] = field(default_factory=dict)

    def add_table(self, table: pa.Table, with_latency: bool = True) -> None:
        """Count a part's (or a unit's) rows; `with_latency` False: counts and metrics only (a whole
        output's counts keep no per-row token times: its latency figures are one run's)."""
        first = table.filter(pc.equal(table["sample_index"], 0))
        self.num_requests += first.num_rows
        self.num_rows += table.num_rows
        self.num_errors += _sum(pc.cast(pc.equal(first["finish_reason"], "error"), pa.int64()))
        self.prompt_tokens += _sum(first["prompt_tokens"])
        self.cached_tokens += _sum(first["cached_tokens"])
        self.completion_tokens += _sum(table["completion_tokens"])
        _add_counts(self.finish_reasons, {d["values"]: d["counts"]  # value_counts: [{"values", "counts"}]
                                          for d in pc.value_counts(table["finish_reason"]).to_pylist()})
        if "error" in table.column_names:
            failed = first.filter(pc.equal(first["finish_reason"], "error"))["error"].to_pylist()
            _add_counts(self.error_reasons, Counter(map(error_reason, failed)))
            self._cap_error_reasons()
        for name in ("ttft_s", "tpot_s"):  # a loglikelihood job's rows have no token times
            if with_latency and name in table.column_names:
                getattr(self, name).append(table[name].drop_null().to_numpy())
        for name, kind in metric_fields_of(table.schema).items():
            self.metric_kinds[name] = kind
            self.metric_verdicts.setdefault(name, []).append(table[metric_column(name)].fill_null(0.0).to_numpy())
            if kind["type"] == "pass_at_k":
                self.metric_ids.setdefault(name, []).append(table["id"].to_pylist())

    def merge(self, other: Totals) -> None:
        """Add another worker's counts, latency figures and metric verdicts (a Ray replica's unit)."""
        for name in ("num_requests", "num_rows", "num_errors", "prompt_tokens", "cached_tokens", "completion_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        _add_counts(self.finish_reasons, other.finish_reasons)
        _add_counts(self.error_reasons, other.error_reasons)
        self._cap_error_reasons()
        self.ttft_s.extend(other.ttft_s)
        self.tpot_s.extend(other.tpot_s)
        self.metric_kinds.update(other.metric_kinds)
        for name, chunks in other.metric_verdicts.items():
            self.metric_verdicts.setdefault(name, []).extend(chunks)
        for name, chunks in other.metric_ids.items():
            self.metric_ids.setdefault(name, []).extend(chunks)

    def metric_scores(self) -> dict[str, MetricFigures]:
        """Each metric's aggregate over the rows added (pass@k: over ids)."""
        scores = {}
        for name, kind in self.metric_kinds.items():
            ids = [i for chunk in self.metric_ids.get(name, []) for i in chunk] or None
            score = aggregate(kind, np.concatenate(self.metric_verdicts[name]), ids)
            scores[name] = (MetricFigures(value=score.value, stderr=score.stderr, n=score.n) if score.n
                            else MetricFigures(value=None, stderr=None, n=0))
        return scores

    def _cap_error_reasons(self) -> None:
        if len(self.error_reasons) > MAX_DISTINCT_REASONS:
            self.error_reasons = top_counts(self.error_reasons, MAX_DISTINCT_REASONS)

    def finish_reasons_by_count(self) -> dict[str, int]:
        """Rows by finish_reason, most first."""
        return top_counts(self.finish_reasons, len(self.finish_reasons))

    def top_error_reasons(self) -> dict[str, int]:
        """The NUM_ERROR_REASONS most frequent error reasons, with their request counts, most first."""
        return top_counts(self.error_reasons, NUM_ERROR_REASONS)

    def copy_counts(self) -> Totals:
        """A Totals with these counts and metric verdicts (their lists copied, so adding to one leaves
        the other as it was) and no latency figures."""
        return dataclasses.replace(
            self, ttft_s=[], tpot_s=[], finish_reasons=dict(self.finish_reasons),
            error_reasons=dict(self.error_reasons), metric_kinds=dict(self.metric_kinds),
            metric_verdicts={k: list(v) for k, v in self.metric_verdicts.items()},
            metric_ids={k: list(v) for k, v in self.metric_ids.items()})


def _add_counts(into: dict[str, int], counts: dict) -> None:
    for key, num in counts.items():
        if key is not None:
            into[key] = into.get(key, 0) + int(num)


def read_summary_table(f) -> pa.Table:
    """The columns Totals counts, of an open part file (a loglikelihood job's parts have no token times;
    a job with metrics adds their verdicts, and the ids for pass@k)."""
    schema = pq.read_schema(f)
    f.seek(0)
    metrics = metric_fields_of(schema)
    extra = [metric_column(name) for name in metrics]
    if any(kind["type"] == "pass_at_k" for kind in metrics.values()):
        extra.append("id")
    return pq.read_table(f, columns=[c for c in SUMMARY_COLUMNS if c in schema.names] + extra)


_SPECULATIVE_COUNTS = ("num_draft_tokens", "num_accepted_tokens", "num_verifies")


def speculative_summary(before: dict | None, after: dict | None) -> SpeculativeFigures | None:
    """Draft and accepted tokens between two engine `stats["speculative"]` readings, with the
    acceptance rate and the mean accepted length. None: speculation off."""
    if after is None:
        return None
    before = before or {}
    return SpeculativeFigures.of_counts(*(after[k] - before.get(k, 0) for k in _SPECULATIVE_COUNTS))


def merge_speculative(parts: list[SpeculativeFigures | None]) -> SpeculativeFigures | None:
    """Several workers' `speculative_summary` figures as one (their counts summed, rates recomputed);
    None when none of them speculated (speculation off: every part None)."""
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    return SpeculativeFigures.of_counts(*(sum(getattr(p, k) for p in parts) for k in _SPECULATIVE_COUNTS))


def structured_summary(before: dict | None, after: dict | None) -> StructuredFigures | None:
    """Constrained requests, grammar compiles and the per-step token mask between two engine
    `stats["structured"]` readings, with the mask's host time per masked step (fill, copy, apply) and
    the constrained rows per masked step. None: no request was constrained."""
    if after is None:
        return None
    before = before or {}
    counts = {k: after[k] - before.get(k, 0) for k in StructuredFigures.COUNTS}
    return StructuredFigures.of_counts(counts) if counts["num_constrained_requests"] else None


def merge_structured(parts: list[StructuredFigures | None]) -> StructuredFigures | None:
    """Several workers' `structured_summary` figures as one (counts summed, rates recomputed)."""
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    return StructuredFigures.of_counts({k: sum(getattr(p, k) for p in parts) for k in StructuredFigures.COUNTS})
