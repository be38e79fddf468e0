"""A metric's aggregate over a run: the mean verdict with lm-eval's standard error, or, for pass@k, the
unbiased pass@k per id averaged over ids. How a column aggregates travels with it: the field metadata of
`metric_<name>` says its type and k, so `_SUCCESS` and the report can aggregate any output folder's parts
without the job file."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from batchgen.metrics.pass_at_k import pass_at_k_by_group
from batchgen.metrics.spec import METRIC_COLUMN_PREFIX, MetricSpec, PassAtK, metric_column

METADATA_KEY = b"batchgen.metric"


@dataclass(frozen=True)
class MetricScore:
    """One metric over a run: `value` (the mean verdict, or mean pass@k), `stderr` (of the mean over
    rows, or over ids for pass@k; lm-eval's mean_stderr, sample standard deviation / sqrt(n)) and `n`
    (rows scored, or ids for pass@k)."""

    value: float
    stderr: float
    n: int

    def interval(self, z: float = 1.96) -> tuple[float, float]:
        """The normal-approximation 95% interval (z = 1.96), within the verdicts' range 0 to 1."""
        return max(0.0, self.value - z * self.stderr), min(1.0, self.value + z * self.stderr)


def mean_with_stderr(values: np.ndarray) -> MetricScore:
    """lm-eval's `mean` and `mean_stderr` (ddof 1; 0 for fewer than two values)."""
    n = int(values.size)
    if n == 0:
        return MetricScore(float("nan"), float("nan"), 0)
    stderr = float(np.std(values, ddof=1) / math.sqrt(n)) if n > 1 else 0.0
    return MetricScore(float(values.mean()), stderr, n)


def metric_field(name: str, spec: MetricSpec) -> pa.Field:
    """The output column of a metric's verdicts, with how it aggregates in its metadata."""
    how = {"type": spec.type, "k": spec.k} if isinstance(spec, PassAtK) else {"type": spec.type}
    return pa.field(metric_column(name), pa.float64(), metadata={METADATA_KEY: json.dumps(how).encode()})


def metric_fields_of(schema: pa.Schema) -> dict[str, dict]:
    """{metric name: {type, k?}} for the metric columns of an output schema."""
    found = {}
    for f in schema:
        if f.name.startswith(METRIC_COLUMN_PREFIX) and f.metadata and METADATA_KEY in f.metadata:
            found[f.name[len(METRIC_COLUMN_PREFIX):]] = json.loads(f.metadata[METADATA_KEY])
    return found


def aggregate(how: dict, verdicts: np.ndarray, ids: list | None = None) -> MetricScore:
    """A metric's aggregate from its per-row verdicts (`how`: the column's metadata). pass@k needs each
    row's id: the rows of one id are its n samples."""
    if how.get("type") != "pass_at_k":
        return mean_with_stderr(np.asarray(verdicts, np.float64))
    value, stderr, num_groups = pass_at_k_by_group(ids, [bool(v) for v in verdicts], int(how["k"]))
    return MetricScore(value, stderr, num_groups)
