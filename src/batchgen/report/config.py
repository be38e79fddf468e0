"""What a report covers and how much of a run it keeps: one frozen config passed whole."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batchgen.metrics import MetricSpec


class ReportError(Exception):
    """The report cannot be made as asked: not an output folder, an unknown column, two different prompt
    sets. The message names the folder, file or column."""


@dataclass(frozen=True)
class ReportConfig:
    """`batchgen report OUT [--against OTHER] [--by COLUMN] [--metric NAME=SPEC ...] [--reference COLUMN] [-o FILE]`.

    The page keeps bounded lists whatever the run's size: the slowest and the failed rows, the ids
    listed as different, missing or flipped, the side-by-side diffs. Counts, scores and plots cover
    every row.
    """

    out: str
    """The run's output folder or URI."""
    against: str | None = None
    """A second run of the same prompts: the baseline of the comparison (rows joined by id and sample_index)."""
    by: str | None = None
    """A kept column whose values name categories: figures per category."""
    reference: str | None = None
    """A kept column holding the expected completion: the metric `exact_match` (an exact_match spec on this
    column: surrounding whitespace ignored, error rows wrong), rows whose reference is null not scored."""
    metrics: dict[str, MetricSpec] = field(default_factory=dict)
    """Metrics scored by the report over every row (batchgen.metrics specs by name), besides the run's own
    `metric_<name>` columns; one named like a run's metric replaces it on the page."""
    continuations_column: str | None = None
    """A loglikelihood run's kept column of continuation texts, for choice metrics that need them
    (choice_accuracy_norm, or labels given as text)."""
    output: str = "report.html"
    """Where the page is written (a path or a URI)."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """fsspec options for every folder read or written."""
    num_slowest: int = 20
    """Slowest rows listed."""
    num_failed: int = 50
    """Failed rows listed."""
    num_listed_ids: int = 500
    """Ids listed per list: different, missing from either run, flipped per metric."""
    num_inline_diffs: int = 8
    """Different rows shown side by side."""
    max_categories: int = 1000
    """Distinct --by values counted apart; the rest count as "(other)"."""
    max_shown_chars: int = 2000
    """Characters of a completion or an error shown on the page."""
    significance_level: float = 0.05
    """A metric's change between two runs is "beyond noise" when McNemar's exact p-value is below this."""
    batch_rows: int = 65_536
    """Rows read from a part at a time."""
    partition_bytes: int = 8 << 20
    """Target in-memory bytes of one join partition, per run."""

    def __post_init__(self) -> None:
        for name in ("num_slowest", "num_failed", "num_listed_ids", "num_inline_diffs", "max_categories",
                     "max_shown_chars", "batch_rows", "partition_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"ReportConfig.{name} must be at least 1, got {getattr(self, name)}")
        if not 0 < self.significance_level < 1:
            raise ValueError(f"ReportConfig.significance_level must be in (0, 1), got {self.significance_level}")
