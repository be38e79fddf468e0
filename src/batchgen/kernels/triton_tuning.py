"""Tile and warp configurations of the Triton kernels: candidates per shape key, and which one runs.

Paged attention is keyed on (head size, query heads per KV head, dtype, FP8 cache), the engine's
constants; the weight-only GEMMs (FP8 W8A16, integer W4A16/W8A16) on (M bucket, K, weight kind,
dtype); the LoRA SGMV shrink/expand on (kind, segment-length bucket, shape, dtype). Each key has a short list of candidates and the FIRST one runs: a fixed choice, so the same
shapes give the same tiles and the same bits in every process (a job rerun reproduces its outputs;
attention's tiles also never change within an engine, which its batch invariance needs).

`BATCHGEN_TRITON_AUTOTUNE=1` instead times every candidate of a key on its first call
(triton.testing.do_bench, eager calls only: never inside a CUDA-graph capture) and keeps the fastest
for the process: for tuning on a new GPU, then reordering these lists. The GPU check
(`python -m batchgen.bench.gpu_check`) prints each attention candidate's bandwidth at the 8B shapes.

Candidates, by what a decode step is bound by (HBM bytes): attention tiles of 64 keys read four
16-token blocks per tile (one dependent block-table load per 64 keys, not per 32) with two stages of
loads in flight; FP8 GEMMs take BLOCK_K >= 64 (a 1-byte weight tile of 64 x 64 is one 4 KiB
transaction per row group) wherever K allows. Every candidate is checked against the torch
reference under the interpreter at small shapes (tests/kernels/test_triton_tuning.py); their
speed awaits a GPU.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger("batchgen.kernels")

AUTOTUNE_ENV = "BATCHGEN_TRITON_AUTOTUNE"


def _check_block_sizes(tiles, names: tuple[str, ...]) -> None:
    for name in names:
        size = getattr(tiles, name)
        if size < 16 or size & (size - 1):
            raise ValueError(f"block sizes must be powers of two >= 16 (tl.dot), got {name}={size}")


@dataclass(frozen=True)
class AttentionTiles:
    """One paged-attention configuration: query rows (queries x heads of a group) and keys per tile."""

    block_m: int = 16
    tile_n: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_m", "tile_n"):
            size = getattr(self, name)
            if size < 16 or size & (size - 1):
                raise ValueError(f"{name} must be a power of two >= 16 (tl.dot), got {size}")


@dataclass(frozen=True)
class GemmTiles:
    """One weight-only GEMM configuration; group_m tile rows share weight tiles in L2 (prefill)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8

    def __post_init__(self) -> None:
        _check_block_sizes(self, ("block_m", "block_n", "block_k"))


@dataclass(frozen=True)
class LoRATiles:
    """One SGMV (LoRA shrink or expand) configuration: block_t tokens of one segment per tile, block_red
    the reduced dimension's tile (the shrink's input features, the expand's rank) and block_out the
    output tile (the shrink's rank columns, the expand's output features)."""

    block_t: int
    block_red: int
    block_out: int
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        _check_block_sizes(self, ("block_t", "block_red", "block_out"))


def lora_candidates(kind: str, max_segment_len: int, dtype: torch.dtype) -> list[LoRATiles]:
    """Candidates for a LoRA "shrink" or "expand", the default first. Decode steps (segments of at most
    16 tokens, the common case) take 16-token tiles and spend the tile on the long dimension (the
    shrink's K, the expand's output features); prefill segments take taller token tiles. Ranks are
    small (8-64), so their tile stays 16 or 32."""
    if kind == "shrink":
        raw = ([(16, 64, 16, 4, 2), (16, 128, 16, 4, 3), (16, 64, 32, 4, 2), (32, 64, 16, 4, 2)]
               if max_segment_len <= 16 else
               [(64, 64, 16, 4, 2), (32, 64, 32, 4, 2), (32, 128, 16, 4, 3), (16, 64, 16, 4, 2)])
    elif kind == "expand":
        raw = ([(16, 16, 64, 4, 2), (16, 16, 128, 4, 2), (16, 32, 64, 4, 2), (32, 16, 64, 4, 2)]
               if max_segment_len <= 16 else
               [(64, 16, 64, 4, 2), (32, 16, 128, 4, 2), (64, 32, 64, 8, 2), (16, 16, 64, 4, 2)])
    else:
        raise ValueError(f"kind must be shrink or expand, got {kind!r}")
    if dtype == torch.float32:  # float32 dots: one stage of loads
        raw = [(t, r, o, w, 1) for t, r, o, w, _ in raw]
    seen: list[LoRATiles] = []
    for values in raw:
        tiles = LoRATiles(*values)
        if tiles not in seen:
            seen.append(tiles)
    return seen


def attention_candidates(head_size: int, num_queries_per_kv: int, dtype: torch.dtype,
                         is_fp8_cache: bool = False) -> list[AttentionTiles]:
    """Candidates for one engine's attention shape, the default first. A group wider than 16 query
    heads takes block_m = its next power of two (one query per tile, every head of the group)."""
    block_m = max(16, 1 << (num_queries_per_kv - 1).bit_length())
    if dtype == torch.float32:  # the interpreter's and float32 models': no tensor cores to feed
        return [AttentionTiles(block_m, 32, 4, 1), AttentionTiles(block_m, 64, 4, 1)]
    if head_size > 128:  # registers: acc is block_m x head_pad float32
        return [AttentionTiles(block_m, 32, 4, 2), AttentionTiles(block_m, 32, 8, 2), AttentionTiles(block_m, 64, 8, 2)]
    # FP8 caches widen in registers: one more stage of 1-byte loads is cheap.
    first = AttentionTiles(block_m, 64, 4, 3 if is_fp8_cache else 2)
    others = [AttentionTiles(block_m, 32, 4, 2), AttentionTiles(block_m, 64, 4, 3), AttentionTiles(block_m, 128, 8, 2),
              AttentionTiles(block_m, 64, 8, 2), AttentionTiles(block_m, 32, 2, 3)]
    return [first] + [t for t in others if t != first]


def gemm_candidates(num_rows: int, k: int, weight: str, dtype: torch.dtype) -> list[GemmTiles]:
    """Candidates for an M of `num_rows` rows, K inputs, weight "fp8" | "int8" | "int4", the default
    first. BLOCK_K is capped at K's next power of two (>= 16): no tile wider than the matrix."""
    cap = max(16, 1 << max(k - 1, 1).bit_length())
    if weight == "fp8":
        if num_rows <= 16:
            raw = [(16, 64, 128, 4, 4), (16, 128, 64, 4, 4), (16, 32, 256, 4, 3), (16, 64, 64, 4, 3)]
        elif num_rows <= 64:
            raw = [(32, 64, 128, 4, 4), (64, 64, 64, 4, 3), (32, 128, 64, 4, 3)]
        else:
            raw = [(64, 128, 64, 4, 3), (128, 128, 64, 8, 3), (64, 256, 64, 8, 3), (128, 64, 128, 4, 3)]
    else:  # int4 / int8: each K tile also reads its groups' scales (and zeros)
        if num_rows <= 16:
            raw = [(16, 64, 64, 4, 3), (16, 128, 64, 4, 3), (16, 64, 128, 4, 3)]
        elif num_rows <= 64:
            raw = [(32, 64, 64, 4, 3), (64, 64, 64, 4, 3)]
        else:
            raw = [(64, 128, 32, 4, 3), (64, 128, 64, 4, 3), (128, 128, 32, 8, 3)]
    if dtype == torch.float32:  # float32 dots: half the tile in the same registers
        raw = [(m, n, min(bk, 64), w, min(s, 2)) for m, n, bk, w, s in raw]
    seen: list[GemmTiles] = []
    for m, n, bk, w, s in raw:
        tiles = GemmTiles(m, n, min(bk, cap), w, s)
        if tiles not in seen:
            seen.append(tiles)
    return seen


def moe_candidates(rows_per_expert: int, k: int, dtype: torch.dtype) -> list[GemmTiles]:
    """Candidates for the fused MoE's grouped GEMMs (kernels/triton_fused_moe.py), keyed on the routed rows
    an expert receives on average (T * k / E): BLOCK_M is the expert's padding unit, so decode-sized
    loads take 16-row blocks (little padding) and prefill-sized ones 64 (weight tiles reused across
    more rows). BLOCK_K is capped at K's next power of two, as gemm_candidates'."""
    cap = max(16, 1 << max(k - 1, 1).bit_length())
    if rows_per_expert <= 16:
        raw = [(16, 64, 64, 4, 3), (16, 128, 64, 4, 3), (16, 64, 128, 4, 4), (32, 64, 64, 4, 3)]
    elif rows_per_expert <= 64:
        raw = [(32, 64, 64, 4, 3), (64, 64, 64, 4, 3), (32, 128, 64, 4, 3)]
    else:
        raw = [(64, 128, 64, 4, 3), (128, 128, 64, 8, 3), (64, 64, 64, 4, 4), (128, 64, 32, 4, 3)]
    if dtype == torch.float32:  # float32 dots: half the tile in the same registers
        raw = [(m, n, min(bk, 32), w, min(s, 2)) for m, n, bk, w, s in raw]
    seen: list[GemmTiles] = []
    for m, n, bk, w, s in raw:
        tiles = GemmTiles(m, n, min(bk, cap), w, s)
        if tiles not in seen:
            seen.append(tiles)
    return seen


def is_autotune_enabled() -> bool:
    return os.environ.get(AUTOTUNE_ENV) == "1"


_chosen: dict[tuple, object] = {}


def choose(key: tuple, candidates: list, run: Callable[[object], None], is_capturing: bool = False):
    """The configuration for `key`: candidates[0], or with autotuning on, the fastest of `run(c)` for
    each c (timed on the first eager call per key, then kept for the process)."""
    if key in _chosen:
        return _chosen[key]
    if not is_autotune_enabled() or is_capturing or len(candidates) == 1:
        return candidates[0]
    from triton.testing import do_bench

    timings = []
    for candidate in candidates:
        try:
            timings.append((do_bench(lambda c=candidate: run(c), warmup=5, rep=20), candidate))
        except Exception as exc:  # noqa: BLE001 - a configuration this GPU cannot run (resources) is skipped
            log.info("autotune %s: %s skipped (%s)", key, candidate, exc)
    best = min(timings, key=lambda t: t[0])[1] if timings else candidates[0]
    _chosen[key] = best
    return best
