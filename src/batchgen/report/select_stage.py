"""A select stage's section of the page: its rule, counts and histograms, from `_SUCCESS`'s `select` entry.

A select stage of a multi-stage job (pipeline/stages/) writes what it counted into its `_SUCCESS`
(RunRecord.select, histograms as pipeline/stages/histogram.py makes them); the console prints the same
figures (stages/text.py select_lines). Read from the record only: the stage's rows are not recounted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from batchgen.pipeline.run_record import RunRecord
from batchgen.pipeline.run_record_text import SummaryRow, count, provenance, seconds
from batchgen.pipeline.stages.histogram import is_integer_histogram

# (key of the select entry, label): the counts in the order the stage counts them
COUNT_LABELS = (
    ("num_input_rows", "input rows"),
    ("num_prompts", "prompts (distinct ids)"),
    ("num_filtered_rows", "rows dropped by where"),
    ("num_unscored_rows", "unscored rows (null or NaN score)"),
    ("num_single_sample", "prompts dropped: fewer than 2 scored samples"),
    ("num_ties", "prompts dropped: every sample tied"),
    ("num_below_margin", "prompts dropped: below min_margin"),
    ("num_output_rows", "output rows"),
)


@dataclass
class HistogramBin:
    """One bin as the page shows it: its label, count and the count over the largest bin's (bar width)."""

    label: str
    count: int
    width: float


@dataclass
class SelectFigures:
    """What the select section shows."""

    rule: str
    counts: list[tuple[str, str, int]]  # (key, label, value) for the keys the record has
    margin_percentiles: list[tuple[str, float]] = field(default_factory=list)
    score_bins: list[HistogramBin] = field(default_factory=list)
    margin_bins: list[HistogramBin] = field(default_factory=list)


def select_figures(record: RunRecord | None) -> SelectFigures | None:
    """The section's figures, or None when the folder is not a select stage's (no `select` entry)."""
    figures = record.select if record is not None else None
    if not isinstance(figures, dict):
        return None
    counts = [(key, label, int(figures[key])) for key, label in COUNT_LABELS
              if isinstance(figures.get(key), int) and not isinstance(figures.get(key), bool)]
    margins = figures.get("margin_percentiles") or {}
    return SelectFigures(rule=str(figures.get("rule")), counts=counts,
                         margin_percentiles=[(str(k), float(v)) for k, v in margins.items()],
                         score_bins=histogram_bins(figures.get("score_histogram")),
                         margin_bins=histogram_bins(figures.get("margin_histogram")))


def histogram_bins(hist: dict | None) -> list[HistogramBin]:
    """Every bin of a stage histogram ({"edges", "counts"}): `centre` for integer bins, `[low, high)`
    otherwise (the last bin closed), as the console labels them; [] when there is none."""
    if not hist:
        return []
    edges, counts = hist["edges"], hist["counts"]
    is_integer = is_integer_histogram(hist)
    largest = max(counts, default=0) or 1
    bins = []
    for i, n in enumerate(counts):
        close = "]" if i == len(counts) - 1 else ")"
        label = f"{edges[i] + 0.5:g}" if is_integer else f"[{edges[i]:.4g}, {edges[i + 1]:.4g}{close}"
        bins.append(HistogramBin(label, int(n), int(n) / largest))
    return bins


def select_summary_rows(record: RunRecord) -> list[SummaryRow]:
    """The summary table of a select stage: the `_SUCCESS` keys that mean something without a model (its
    token counts and latencies are zeros by construction; num_requests counts the prompts it read)."""
    return [SummaryRow(*row) for row in (
        ("job", "job", record.job),
        ("config_hash", "config hash", record.config_hash),
        ("num_requests", "prompts read", count(record.num_requests)),
        ("num_rows", "output rows", count(record.num_rows)),
        ("generation_seconds", "took", seconds(record.generation_seconds)),
        ("provenance", "provenance", provenance(record.provenance)),
    )]
