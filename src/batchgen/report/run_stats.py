"""One run's figures, gathered part by part in bounded memory.

Per row the run keeps only numbers (float32 latencies, int32 lengths, small codes: 4 x 4 + 9 bytes,
about 25 MB for 1M rows, and a float64 verdict per metric); text is kept only for the slowest rows (a
heap) and the first failed ones. No column beyond id and sample_index is assumed: a loglikelihood run's
rows have no completion and no token times, and what a run lacks is shown as absent.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from batchgen.report.config import ReportConfig
from batchgen.report.metric_scores import RunScores, ShownScore
from batchgen.report.source import RunFolder

LATENCY_COLUMNS = ("queue_s", "ttft_s", "tpot_s", "e2e_s")
_BASE_COLUMNS = ["id", "sample_index", "completion", "finish_reason", "prompt_tokens", "cached_tokens",
                 "completion_tokens", *LATENCY_COLUMNS, "error"]
SHOWN_ROW_KEYS = ("id", "sample_index", "completion", "finish_reason", "completion_tokens", *LATENCY_COLUMNS, "error")
OTHER_CATEGORY = "(other)"
NULL_CATEGORY = "(null)"


class Codes:
    """Values -> small integer codes in order of first sight; past `capacity` distinct values, one
    shared code for the rest."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.names: list[str] = []
        self._codes: dict[object, int] = {}
        self._other: int | None = None

    def encode(self, column: pa.Array | pa.ChunkedArray) -> np.ndarray:
        encoded = pc.dictionary_encode(column)
        if isinstance(encoded, pa.ChunkedArray):
            encoded = encoded.combine_chunks()
        local = np.array([self._code(v) for v in encoded.dictionary.to_pylist()] + [self._code(None)],
                         dtype=np.int32)
        indices = encoded.indices.fill_null(len(local) - 1).to_numpy(zero_copy_only=False)
        return local[indices]

    def _code(self, value: object) -> int:
        if value in self._codes:
            return self._codes[value]
        if len(self.names) >= self.capacity:
            if self._other is None:
                self._other = len(self.names)
                self.names.append(OTHER_CATEGORY)
            return self._other
        self._codes[value] = len(self.names)
        self.names.append(NULL_CATEGORY if value is None else str(value))
        return self._codes[value]


@dataclass
class LatencyFigures:
    p50: float | None
    p90: float | None
    p99: float | None
    mean: float | None
    count: int


def latency_figures(values: np.ndarray) -> LatencyFigures:
    values = values[~np.isnan(values)]
    if values.size == 0:
        return LatencyFigures(None, None, None, None, 0)
    p50, p90, p99 = np.percentile(values.astype(np.float64), [50, 90, 99])
    return LatencyFigures(float(p50), float(p90), float(p99), float(values.mean(dtype=np.float64)), int(values.size))


@dataclass
class CategoryRow:
    name: str
    num_rows: int
    num_errors: int
    mean_completion_tokens: float
    length_share: float  # rows that stopped at max_tokens / max_model_len
    e2e: LatencyFigures
    scores: dict[str, float | None] = field(default_factory=dict)  # metric name -> mean verdict of the scored rows


@dataclass
class RunFigures:
    """What the page shows of one run (besides its `_SUCCESS`)."""

    num_rows: int
    num_requests: int
    num_error_requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    latency: dict[str, LatencyFigures]
    finish_reasons: list[tuple[str, int]]  # most frequent first
    slowest: list[dict]  # slowest e2e first
    failed: list[dict]  # the first failed rows, in folder order
    num_failed_rows: int
    categories: list[CategoryRow] = field(default_factory=list)
    scores: list[ShownScore] = field(default_factory=list)  # the run's metrics, in the order listed
    latency_columns: list[str] = field(default_factory=list)  # the LATENCY_COLUMNS the run's rows have
    part_times: list[float | None] = field(default_factory=list)
    part_tokens: list[int] = field(default_factory=list)
    # The per-row arrays the plots draw (shared with RunStats, not copies).
    latency_values: dict[str, np.ndarray] = field(default_factory=dict)
    lengths: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    finish_codes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int8))
    finish_names: list[str] = field(default_factory=list)


class RunStats:
    """Feed it every batch of a run (`add`), then read `figures()`. Arrays are sized from the footers."""

    def __init__(self, folder: RunFolder, config: ReportConfig):
        self.folder = folder
        self.config = config
        n = folder.num_rows
        self.latency = {name: np.full(n, np.nan, np.float32) for name in LATENCY_COLUMNS}
        self.completion_tokens = np.zeros(n, np.int32)
        self.finish = Codes(64)
        self.finish_code = np.zeros(n, np.int8)
        self.by = config.by
        self.category = Codes(config.max_categories)
        self.category_code = np.zeros(n, np.int32) if config.by else None
        self.scores = RunScores(folder, config)
        self.part_tokens = np.zeros(len(folder.parts), np.int64)
        self.num_requests = self.num_error_requests = self.prompt_tokens = self.cached_tokens = 0
        self._slowest: list[tuple[float, int, dict]] = []
        self._tiebreak = itertools.count()
        self.failed: list[dict] = []
        self.num_failed_rows = 0
        self._filled = 0
        if config.by is not None:
            folder.check_column(config.by, "--by")

    @property
    def columns(self) -> list[str]:
        extra = [c for c in [self.by, *self.scores.columns] if c is not None and c not in _BASE_COLUMNS]
        return [c for c in _BASE_COLUMNS if c in self.folder.column_names] + list(dict.fromkeys(extra))

    def add(self, part_index: int, batch: pa.RecordBatch) -> dict[str, np.ndarray]:
        """Count one batch (of `columns`); returns its verdicts per metric (RunScores.add)."""
        n = batch.num_rows
        rows = slice(self._filled, self._filled + n)
        self._filled += n
        for name in LATENCY_COLUMNS:
            if name in batch.schema.names:
                self.latency[name][rows] = batch.column(name).to_numpy(zero_copy_only=False)  # nulls -> nan
        tokens = _column(batch, "completion_tokens", pa.int64()).fill_null(0).to_numpy(zero_copy_only=False)
        self.completion_tokens[rows] = tokens
        self.part_tokens[part_index] += int(tokens.sum())
        finish_reason = _column(batch, "finish_reason", pa.string())
        self.finish_code[rows] = self.finish.encode(finish_reason)
        if "sample_index" in batch.schema.names:
            first = pc.equal(batch.column("sample_index"), 0).fill_null(False)
        else:  # a select stage's rows (dpo pairs, best of n): one row per prompt
            first = pa.array(np.ones(n, dtype=bool))
        failed = pc.equal(finish_reason, "error").fill_null(False)
        self.num_requests += pc.sum(first).as_py() or 0
        self.num_error_requests += pc.sum(pc.and_(first, failed)).as_py() or 0
        self.prompt_tokens += pc.sum(pc.filter(_column(batch, "prompt_tokens", pa.int64()), first)).as_py() or 0
        self.cached_tokens += pc.sum(pc.filter(_column(batch, "cached_tokens", pa.int64()), first)).as_py() or 0
        if self.category_code is not None:
            self.category_code[rows] = self.category.encode(batch.column(self.by))
        verdicts = self.scores.add(batch)
        self._keep_slowest(batch)
        self._keep_failed(batch, failed)
        return verdicts

    def figures(self) -> RunFigures:
        counts = np.bincount(self.finish_code, minlength=len(self.finish.names))
        finish = sorted(((name, int(c)) for name, c in zip(self.finish.names, counts) if c), key=lambda x: -x[1])
        return RunFigures(
            num_rows=self._filled, num_requests=self.num_requests, num_error_requests=self.num_error_requests,
            prompt_tokens=self.prompt_tokens, cached_tokens=self.cached_tokens,
            completion_tokens=int(self.completion_tokens.sum(dtype=np.int64)),
            latency={name: latency_figures(values) for name, values in self.latency.items()},
            finish_reasons=finish,
            slowest=[row for _, _, row in sorted(self._slowest, reverse=True)],
            failed=self.failed, num_failed_rows=self.num_failed_rows,
            categories=self._category_rows(), scores=self.scores.results(),
            latency_columns=[c for c in LATENCY_COLUMNS if c in self.folder.column_names],
            part_times=[p.committed_at for p in self.folder.parts], part_tokens=self.part_tokens.tolist(),
            latency_values=self.latency, lengths=self.completion_tokens, finish_codes=self.finish_code,
            finish_names=self.finish.names,
        )

    def code_of(self, finish_reason: str) -> int | None:
        return self.finish.names.index(finish_reason) if finish_reason in self.finish.names else None

    def _category_rows(self) -> list[CategoryRow]:
        if self.category_code is None:
            return []
        error, length = self.code_of("error"), self.code_of("length")
        rows = []
        order = np.argsort(self.category_code, kind="stable")
        codes = self.category_code[order]
        bounds = np.flatnonzero(np.diff(codes)) + 1
        for group in np.split(order, bounds):
            if group.size == 0:
                continue
            finish = self.finish_code[group]
            rows.append(CategoryRow(
                name=self.category.names[self.category_code[group[0]]], num_rows=int(group.size),
                num_errors=int((finish == error).sum()) if error is not None else 0,
                mean_completion_tokens=float(self.completion_tokens[group].mean()),
                length_share=float((finish == length).mean()) if length is not None else 0.0,
                e2e=latency_figures(self.latency["e2e_s"][group]),
                scores={name: _mean_scored(self.scores.verdicts[name][group]) for name in self.scores.names}))
        return sorted(rows, key=lambda r: (-r.num_rows, r.name))

    def _keep_slowest(self, batch: pa.RecordBatch) -> None:
        if "e2e_s" not in batch.schema.names:
            return
        e2e = batch.column("e2e_s").to_numpy(zero_copy_only=False)
        valid = np.flatnonzero(~np.isnan(e2e))
        k = min(self.config.num_slowest, valid.size)
        if k == 0:
            return
        top = valid[np.argpartition(e2e[valid], valid.size - k)[valid.size - k:]]
        floor = self._slowest[0][0] if len(self._slowest) >= self.config.num_slowest else -np.inf
        for i in top[e2e[top] > floor]:
            entry = (float(e2e[i]), next(self._tiebreak), self._row(batch, int(i)))
            if len(self._slowest) < self.config.num_slowest:
                heapq.heappush(self._slowest, entry)
            elif entry[0] > self._slowest[0][0]:
                heapq.heapreplace(self._slowest, entry)

    def _keep_failed(self, batch: pa.RecordBatch, failed: pa.Array) -> None:
        indices = np.flatnonzero(failed.to_numpy(zero_copy_only=False))
        self.num_failed_rows += indices.size
        for i in indices[:max(0, self.config.num_failed - len(self.failed))]:
            self.failed.append(self._row(batch, int(i)))

    def _row(self, batch: pa.RecordBatch, i: int) -> dict:
        """One row as the page shows it (long text cut; what the run's rows lack is None)."""
        row = dict.fromkeys(SHOWN_ROW_KEYS)
        row.update({name: batch.column(name)[i].as_py() for name in batch.schema.names})
        for name in ("completion", "error"):
            if isinstance(row.get(name), str):
                row[name] = clip(row[name], self.config.max_shown_chars)
        if self.by is not None:
            row["category"] = NULL_CATEGORY if row.get(self.by) is None else str(row[self.by])
        return row


def clip(text: str, max_chars: int) -> str:
    return text if len(text) <= max_chars else text[:max_chars] + f" [... {len(text) - max_chars:,} more characters]"


def _column(batch: pa.RecordBatch, name: str, type_: pa.DataType) -> pa.Array:
    """The batch's column, or nulls where the run's rows lack it."""
    return batch.column(name) if name in batch.schema.names else pa.nulls(batch.num_rows, type_)


def _mean_scored(verdicts: np.ndarray) -> float | None:
    scored = verdicts[~np.isnan(verdicts)]
    return float(scored.mean()) if scored.size else None
