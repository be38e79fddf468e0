"""Score and margin histograms of a select stage (the `select` entry of `_SUCCESS`, printed by `run`).

A histogram is {"edges": [...], "counts": [...]} with len(edges) == len(counts) + 1, bins closed on the
left and the last also on the right (numpy.histogram's convention). Integer-valued data spanning at most
MAX_INTEGER_BINS values (a judge's 1-5 score) gets one bin per integer, centred on it; other data
NUM_BINS equal-width bins over its range.
"""

from __future__ import annotations

import numpy as np

NUM_BINS = 10
MAX_INTEGER_BINS = 20


def histogram(values) -> dict[str, list] | None:
    """The histogram of finite `values` (None when there are none)."""
    data = np.asarray(values, dtype=np.float64)
    data = data[np.isfinite(data)]
    if data.size == 0:
        return None
    low, high = float(data.min()), float(data.max())
    if np.all(data == np.round(data)) and high - low < MAX_INTEGER_BINS:
        bins = np.arange(low - 0.5, high + 1.0, 1.0)
    else:
        bins = NUM_BINS if high > low else np.array([low - 0.5, low + 0.5])
    counts, edges = np.histogram(data, bins=bins)
    return {"edges": [float(e) for e in edges], "counts": [int(c) for c in counts]}


def is_integer_histogram(hist: dict[str, list]) -> bool:
    """Whether the bins are one per integer, centred on it (labelled by the integer)."""
    edges = hist["edges"]
    return all(e + 0.5 == round(e + 0.5) for e in edges) and all(b - a == 1.0 for a, b in zip(edges, edges[1:]))


def format_histogram(hist: dict[str, list]) -> str:
    """One line: each non-empty bin as `centre: count` for integer bins, `[low, high): count` otherwise."""
    edges, counts = hist["edges"], hist["counts"]
    is_integer = is_integer_histogram(hist)
    parts = []
    for i, n in enumerate(counts):
        if not n:
            continue
        close = "]" if i == len(counts) - 1 else ")"
        label = f"{edges[i] + 0.5:g}" if is_integer else f"[{edges[i]:.4g}, {edges[i + 1]:.4g}{close}"
        parts.append(f"{label}: {n}")
    return ", ".join(parts)
