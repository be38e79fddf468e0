"""A job's metrics applied to its output rows as they are written: the `metric_<name>` columns of every
part (batchgen.metrics scores them; this module only knows the job)."""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import pyarrow as pa

from batchgen.metrics import metric_column, score_table
from batchgen.pipeline.config import JobConfig

MetricScorer = Callable[[pa.Table], dict[str, np.ndarray]]


def job_metric_scorer(job: JobConfig) -> MetricScorer | None:
    """table (a part's rows without their verdicts) -> {metric column: verdicts}; None: no metrics."""
    if not job.metrics:
        return None
    # Code metrics run one subprocess per sample: as many at once as the machine has cores.
    num_workers = max(1, min(8, os.cpu_count() or 1))

    def score(table: pa.Table) -> dict[str, np.ndarray]:
        return {metric_column(name): score_table(name, spec, table, continuations_column=job.input.scored_column,
                                                 num_workers=num_workers)
                for name, spec in job.metrics.items()}
    return score
