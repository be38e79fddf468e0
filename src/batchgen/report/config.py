"""What a report covers and how much of a run it keeps: one frozen config passed whole."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class ReportError(Exception):
    """The report cannot be made as asked: not an output folder, an unknown column, two different prompt
    sets. The message names the folder, file or column."""


@dataclass(frozen=True)
class ReportConfig:
    """`batchgen report OUT [--against OTHER] [--by COLUMN] [--reference COLUMN] [-o FILE]`.

    The page keeps bounded lists whatever the run's size: the slowest and the failed rows, the ids
    listed as different or missing, the side-by-side diffs. Counts and plots cover every row.
    """

    out: str
    """The run's output folder or URI."""
    against: str | None = None
    """A second run of the same prompts: the baseline of the comparison (rows joined by id and sample_index)."""
    by: str | None = None
    """A kept column whose values name categories: figures per category."""
    reference: str | None = None
    """A kept column holding the expected completion: exact match (surrounding whitespace ignored)."""
    output: str = "report.html"
    """Where the page is written (a path or a URI)."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """fsspec options for every folder read or written."""
    num_slowest: int = 20
    """Slowest rows listed."""
    num_failed: int = 50
    """Failed rows listed."""
    num_listed_ids: int = 500
    """Ids listed per list: different, missing from either run."""
    num_inline_diffs: int = 8
    """Different rows shown side by side."""
    max_categories: int = 1000
    """Distinct --by values counted apart; the rest count as "(other)"."""
    max_shown_chars: int = 2000
    """Characters of a completion or an error shown on the page."""
    batch_rows: int = 65_536
    """Rows read from a part at a time."""
    partition_bytes: int = 8 << 20
    """Target in-memory bytes of one join partition, per run."""

    def __post_init__(self) -> None:
        for name in ("num_slowest", "num_failed", "num_listed_ids", "num_inline_diffs", "max_categories",
                     "max_shown_chars", "batch_rows", "partition_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"ReportConfig.{name} must be at least 1, got {getattr(self, name)}")
