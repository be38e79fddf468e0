"""How figures read on the page (also the jinja2 filters). The numbers are formatted as the run
summary formats them (pipeline/run_record_text.py: counts with thousands separators, latencies in
milliseconds), so the page, its test and `batchgen run`'s table agree on what a shown number means."""

from __future__ import annotations

import json
import math

from batchgen.pipeline.run_record_text import NONE, count, ms, rate, seconds, share

__all__ = ["FILTERS", "NONE", "count", "delta", "ms", "p_value", "rate", "score", "score_delta", "score_source",
           "seconds", "share", "value"]


def value(v: object) -> str:
    """A _SUCCESS value as text: strings as they are, anything else as JSON."""
    if isinstance(v, str):
        return v
    return json.dumps(v, sort_keys=True, default=str)


def delta(new: float | None, old: float | None, unit: str = "", scale: float = 1.0, digits: int = 1) -> str:
    """new - old with its sign, and relative to old when old is not 0."""
    if new is None or old is None:
        return NONE
    diff = (new - old) * scale
    text = f"{diff:+,.{digits}f}{unit}"
    if old:
        text += f" ({(new - old) / abs(old):+.1%})"
    return text


def score(v: float | None) -> str:
    """A metric's value, interval bound or standard error: 4 decimals (a share of rows, or pass@k)."""
    return NONE if v is None or not math.isfinite(v) else f"{v:.4f}"


def score_delta(v: float | None) -> str:
    return NONE if v is None or not math.isfinite(v) else f"{v:+.4f}"


def p_value(p: float) -> str:
    """A p-value to 3 significant digits (1e-12, not 0.0000)."""
    return f"{p:.3g}"


def score_source(s) -> str:
    """Where a ShownScore comes from: the job (its _SUCCESS, or its verdict columns) or this report."""
    if s.source == "job":
        return "job (_SUCCESS)" if s.is_from_success else "job (verdict columns)"
    return s.source


FILTERS = {"number": count, "ms": ms, "seconds": seconds, "rate": rate, "share": share, "value": value,
           "score": score}
