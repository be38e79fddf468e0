"""How figures read on the page (also the jinja2 filters). One place, so the page and its test agree
on what a shown number means: counts with thousands separators, latencies in milliseconds."""

from __future__ import annotations

import json

from batchgen.pipeline.summary import describe_workers

NONE = "-"


def count(value: int | None) -> str:
    return NONE if value is None else f"{int(value):,}"


def ms(seconds: float | None) -> str:
    return NONE if seconds is None else f"{seconds * 1000:,.1f} ms"


def seconds(value: float | None) -> str:
    return NONE if value is None else f"{value:,.2f} s"


def rate(value: float | None) -> str:
    return NONE if value is None else f"{value:,.1f}"


def share(value: float | None) -> str:
    return NONE if value is None else f"{value:.1%}"


def value(v: object) -> str:
    """A _SUCCESS value as text: strings as they are, anything else as JSON."""
    if isinstance(v, str):
        return v
    return json.dumps(v, sort_keys=True, default=str)


def pairs(mapping: dict | None) -> str:
    """{"device": "cpu", ...} -> "device cpu, ..." (the run summary's style)."""
    return ", ".join(f"{k} {v}" for k, v in (mapping or {}).items()) or NONE


def weights(w: dict | None) -> str:
    if not w:
        return NONE
    text = f"{w.get('format', '?')} ({w.get('origin', '?')})"
    if isinstance(w.get("linear_bytes"), (int, float)):
        text += f", linear layers {w['linear_bytes'] / 1e6:,.1f} MB"
    if isinstance(w.get("linear_bytes_vs_float32"), (int, float)):
        text += f" ({w['linear_bytes_vs_float32']:.1%} of float32)"
    return text


def speculative(spec: dict | None) -> str:
    if not spec:
        return "off"
    if not spec.get("num_draft_tokens"):
        return "no drafts"
    return (f"{spec['num_accepted_tokens']:,} of {spec['num_draft_tokens']:,} draft tokens accepted "
            f"({spec['acceptance_rate']:.0%}), {spec['mean_accepted_length']:.2f} tokens per verify")


def workers(w: dict | None) -> str:
    return describe_workers(w) if w else NONE


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
