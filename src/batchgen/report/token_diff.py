"""Where two runs' token lists part, for whole columns at once (no Python loop over rows)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

SAME = -1
_CHUNK_ROWS = 16_384  # rows compared at once: bounds the index arrays built per chunk


def _flat(lists: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(values, starts, lengths) of a list column; a null list has length 0."""
    if isinstance(lists, pa.ChunkedArray):
        lists = lists.combine_chunks() if lists.num_chunks else pa.array([], lists.type)
    offsets = lists.offsets.to_numpy()  # absolute positions into .values, also for a sliced array
    valid = lists.is_valid().to_numpy(zero_copy_only=False)
    lengths = np.where(valid, offsets[1:] - offsets[:-1], 0)
    values = lists.values.to_numpy(zero_copy_only=False)
    return values, offsets[:-1], lengths


def first_difference(a: pa.Array | pa.ChunkedArray, b: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """Per row of two list columns of equal length: the first position where the lists differ (a shorter
    list that is a prefix of the longer one differs at its own length), or SAME (-1) when equal."""
    values_a, starts_a, len_a = _flat(a)
    values_b, starts_b, len_b = _flat(b)
    common = np.minimum(len_a, len_b)  # (rows,)
    first = np.where(len_a != len_b, common, SAME).astype(np.int64)
    for lo in range(0, common.size, _CHUNK_ROWS):
        hi = min(lo + _CHUNK_ROWS, common.size)
        counts = common[lo:hi]
        row = np.repeat(np.arange(lo, hi), counts)  # (tokens compared in the chunk,)
        pos = np.arange(row.size) - np.repeat(np.cumsum(counts) - counts, counts)
        differs = values_a[starts_a[row] + pos] != values_b[starts_b[row] + pos]
        rows_differing, where = np.unique(row[differs], return_index=True)  # positions rise within a row
        first[rows_differing] = pos[differs][where]
    return first
