"""How figures read on the page (also the jinja2 filters). The numbers are formatted as the run
summary formats them (pipeline/run_record_text.py: counts with thousands separators, latencies in
milliseconds), so the page, its test and `batchgen run`'s table agree on what a shown number means."""

from __future__ import annotations

import json

from batchgen.pipeline.run_record_text import NONE, count, ms, rate, seconds, share

__all__ = ["FILTERS", "NONE", "count", "delta", "ms", "rate", "seconds", "share", "value"]


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


FILTERS = {"number": count, "ms": ms, "seconds": seconds, "rate": rate, "share": share, "value": value}
