"""A run's scores as the report shows them: the run's own metrics (the `metric_<name>` columns a job with
a `metrics:` section writes, their aggregates from `_SUCCESS`) and the metrics asked of the report
(`--metric NAME=SPEC`, `--reference COLUMN`), scored part by part, batch by batch, with batchgen.metrics.
Per row only the float verdict is kept (NaN: not scored); the row ids too, for pass@k alone (its
aggregate groups the samples of one id).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import yaml
from pydantic import TypeAdapter, ValidationError

from batchgen.metrics import (
    MetricError,
    MetricScore,
    MetricSpec,
    aggregate,
    check_metric_name,
    metric_column,
    metric_fields_of,
    score_table,
)
from batchgen.metrics.spec import ExactMatch, PassAtK
from batchgen.report.config import ReportConfig, ReportError
from batchgen.report.source import RunFolder

REFERENCE_METRIC = "exact_match"  # the name --reference COLUMN scores under
_SPEC = TypeAdapter(MetricSpec)
_EXAMPLE = "--metric 'em={type: exact_match, reference_column: answer, ignore_case: true}'"


@dataclass(frozen=True)
class ReportMetric:
    """One metric on the page: read from the run's column (`spec` None) or scored by the report."""

    name: str
    how: dict
    """How its verdicts aggregate: the column's metadata, {"type": ..., "k": ...} (k for pass@k only)."""
    source: str
    """job (the run's column), --metric or --reference."""
    spec: MetricSpec | None = None
    unscored_if_null: str | None = None
    """--reference: rows whose reference (this column) is null are not scored."""


@dataclass(frozen=True)
class ShownScore:
    """A metric's aggregate over one run, as the page and `batchgen report --json` give it."""

    name: str
    type: str
    source: str
    score: MetricScore
    k: int | None = None
    is_from_success: bool = False
    """The aggregate is `_SUCCESS`'s (the job's own), not counted from the parts here."""

    @property
    def interval(self) -> tuple[float, float]:
        return self.score.interval()

    def to_dict(self) -> dict:
        low, high = self.interval
        entry = {"type": self.type, "value": _finite(self.score.value), "stderr": _finite(self.score.stderr),
                 "n": self.score.n, "interval": [_finite(low), _finite(high)], "source": self.source}
        return entry if self.k is None else {**entry, "k": self.k}


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def parse_metric_option(text: str) -> tuple[str, MetricSpec]:
    """`NAME=SPEC` (SPEC: a YAML mapping, the job file's `metrics.NAME`) as its name and spec; ReportError
    naming the metric and what is wrong."""
    name, sep, body = text.partition("=")
    name = name.strip()
    if not sep or not name:
        raise ReportError(f"--metric {text!r}: write NAME=SPEC, e.g. {_EXAMPLE}")
    try:
        check_metric_name(name)
        raw = yaml.safe_load(body)
    except (ValueError, yaml.YAMLError) as exc:
        raise ReportError(f"--metric {name}: {' '.join(str(exc).split())}") from None
    if not isinstance(raw, dict):
        raise ReportError(f"--metric {name}: the spec is not a YAML mapping ({body!r}); e.g. {_EXAMPLE}")
    try:
        return name, _SPEC.validate_python(raw)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'spec'}: {e['msg']}" for e in exc.errors())
        raise ReportError(f"--metric {name}: {problems}") from None


def report_metrics(folder: RunFolder, config: ReportConfig) -> list[ReportMetric]:
    """The run's metric columns and the metrics asked of the report (those replace a column of their name),
    each asked one checked against the run's columns (ReportError naming the metric and the column)."""
    asked: dict[str, tuple[MetricSpec, str]] = {name: (spec, "--metric") for name, spec in config.metrics.items()}
    if config.reference is not None:
        if REFERENCE_METRIC in asked:
            raise ReportError(f"--reference {config.reference} scores the metric {REFERENCE_METRIC!r}, and "
                              f"--metric {REFERENCE_METRIC}=... names it too: rename the --metric")
        asked[REFERENCE_METRIC] = (ExactMatch(type="exact_match", reference_column=config.reference), "--reference")
    columns = metric_fields_of(folder.schema) if folder.schema is not None else {}
    found = [ReportMetric(name, how, "job") for name, how in columns.items() if name not in asked]
    for name, (spec, source) in asked.items():
        if folder.schema is not None:
            _check_columns(folder, name, spec, source, config)
        how = {"type": spec.type, "k": spec.k} if isinstance(spec, PassAtK) else {"type": spec.type}
        found.append(ReportMetric(name, how, source, spec,
                                  config.reference if source == "--reference" else None))
    return found


def _check_columns(folder: RunFolder, name: str, spec: MetricSpec, source: str, config: ReportConfig) -> None:
    flag = "--reference" if source == "--reference" else f"--metric {name}"
    scoring = "continuation_logprob" in folder.column_names
    if spec.is_choice and not scoring:
        raise ReportError(f"{flag}: {spec.type} scores a loglikelihood run's continuations; {folder.url} has no "
                          "column 'continuation_logprob' (a generate run: score its completions)")
    if not spec.is_choice and "completion" not in folder.column_names:
        what = " (a loglikelihood run: use choice_accuracy)" if scoring else ""
        raise ReportError(f"{flag}: {spec.type} scores completions; {folder.url} has no column 'completion'{what}")
    needed = list(spec.input_columns)
    if spec.is_choice and config.continuations_column is not None:
        needed.append(config.continuations_column)
    for column in needed:
        if column not in folder.column_names:
            shown = f"{flag}: " if source == "--metric" else f"{flag} {column}: "
            raise ReportError(f"{shown}{folder.url} has no column {column!r}; its columns are: "
                              f"{', '.join(folder.column_names)}")


class RunScores:
    """Feed it every batch of a run (`add`, which gives the batch's verdicts), then read `results()`."""

    def __init__(self, folder: RunFolder, config: ReportConfig):
        self.folder = folder
        self.config = config
        self.metrics = report_metrics(folder, config)
        self.verdicts = {m.name: np.full(folder.num_rows, np.nan) for m in self.metrics}
        self.ids: list | None = [] if any(m.how.get("type") == "pass_at_k" for m in self.metrics) else None
        self._filled = 0

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.metrics]

    @property
    def columns(self) -> list[str]:
        """The columns the metrics read."""
        needed = ["id"] if self.ids is not None else []
        for m in self.metrics:
            if m.spec is None:
                needed.append(metric_column(m.name))
                continue
            needed += ["continuation_logprob"] if m.spec.is_choice else ["completion"]
            needed += m.spec.input_columns
            if m.spec.is_choice and self.config.continuations_column is not None:
                needed.append(self.config.continuations_column)
        return list(dict.fromkeys(needed))

    def add(self, batch: pa.RecordBatch) -> dict[str, np.ndarray]:
        """Score one batch: {metric name: float64 verdict per row (NaN: not scored)}."""
        rows = slice(self._filled, self._filled + batch.num_rows)
        self._filled += batch.num_rows
        table = pa.Table.from_batches([batch]) if any(m.spec is not None for m in self.metrics) else None
        scored = {}
        for m in self.metrics:
            if m.spec is None:
                verdicts = batch.column(metric_column(m.name)).to_numpy(zero_copy_only=False).astype(np.float64)
            else:
                verdicts = self._score(m, table)
            self.verdicts[m.name][rows] = verdicts
            scored[m.name] = verdicts
        if self.ids is not None:
            self.ids.extend(batch.column("id").to_pylist())
        return scored

    def _score(self, metric: ReportMetric, table: pa.Table) -> np.ndarray:
        try:
            verdicts = score_table(metric.name, metric.spec, table,
                                   continuations_column=self.config.continuations_column)
        except MetricError as exc:
            hint = (" (name the run's kept column of continuation texts with --continuations-column)"
                    if "continuations" in str(exc) and self.config.continuations_column is None else "")
            raise ReportError(f"{self.folder.url}: {exc}{hint}") from None
        if metric.unscored_if_null is not None:
            verdicts = np.where(pc.is_valid(table.column(metric.unscored_if_null)).to_numpy(zero_copy_only=False),
                                verdicts, np.nan)
        return verdicts

    def results(self) -> list[ShownScore]:
        """Each metric's aggregate: `_SUCCESS`'s for the run's own metrics when it has one, else over the
        scored rows of the parts; then the metrics `_SUCCESS` names whose columns the parts lack."""
        recorded = self.folder.success_metrics
        shown = []
        for m in self.metrics:
            k = m.how.get("k") if m.how.get("type") == "pass_at_k" else None
            if m.source == "job" and m.name in recorded:
                entry = recorded[m.name]
                score = MetricScore(float(entry["value"]), float(entry["stderr"]), int(entry["n"]))
                shown.append(ShownScore(m.name, m.how.get("type", "?"), m.source, score, k, is_from_success=True))
                continue
            shown.append(ShownScore(m.name, m.how.get("type", "?"), m.source, self.aggregate(m.name), k))
        for name, entry in recorded.items():
            if name not in self.names:
                score = MetricScore(float(entry["value"]), float(entry["stderr"]), int(entry["n"]))
                shown.append(ShownScore(name, str(entry.get("type", "?")), "job", score, is_from_success=True))
        return shown

    def aggregate(self, name: str, rows: np.ndarray | None = None) -> MetricScore:
        """The metric's aggregate over its scored rows (of `rows`, indices into the run's rows, when given)."""
        how = next(m.how for m in self.metrics if m.name == name)
        verdicts = self.verdicts[name] if rows is None else self.verdicts[name][rows]
        scored = ~np.isnan(verdicts)
        ids = None
        if self.ids is not None:
            index = np.flatnonzero(scored) if rows is None else np.asarray(rows)[scored]
            ids = [self.ids[int(i)] for i in index]
        return aggregate(how, verdicts[scored], ids)
