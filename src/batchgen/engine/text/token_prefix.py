"""How many leading tokens two token-id sequences share: prefix grouping in the pipeline, output agreement in
benchmarks and run comparisons. Below both, so neither imports the other for it."""

from __future__ import annotations


def num_shared_prefix(a: list[int], b: list[int], cap: int | None = None) -> int:
    """How many leading tokens a and b share (counting stops at `cap`)."""
    limit = min(len(a), len(b)) if cap is None else min(len(a), len(b), cap)
    i = 0
    while i < limit and a[i] == b[i]:
        i += 1
    return i
