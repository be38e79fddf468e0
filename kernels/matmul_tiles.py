"""Tile sizes of the Triton weight-only GEMMs (FP8 W8A16, integer W4A16/W8A16), chosen by M alone.

Decode steps (a few rows) are bound by the weight bytes: a short M tile wastes no rows and a wide N
tile streams the weight. Prefill steps are compute-bound: square tiles reuse each widened weight
tile across more rows. The choice depends on M only, never on the batch's contents.
"""

from __future__ import annotations


def tiles_for(num_rows: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) for an M of `num_rows` (powers of two >= 16, as tl.dot needs)."""
    if num_rows <= 16:
        return 16, 64, 64
    if num_rows <= 64:
        return 32, 64, 64
    return 64, 128, 32


def check_tiles(tiles: tuple[int, int, int]) -> None:
    for block in tiles:
        if block < 16 or block & (block - 1):
            raise ValueError(f"block sizes must be powers of two >= 16 (tl.dot), got {block}")
