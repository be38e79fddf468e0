"""Packed token bitmasks: allocate, unpack, and apply to the constrained rows of a logits tensor in place.

A bitmask row is ceil(V / 32) int32 words; bit j of word w (two's complement, little-endian bit
order) allows token 32w + j. Only constrained rows have a bitmask row: `rows` says which logits row
each one masks, and every other logits row is left exactly as it was.

`apply_token_bitmask` runs the grammar library's kernel where it has one (xgrammar: C++ on the CPU
for float32 / bfloat16 / float16 logits, Triton on CUDA), else torch ops that run on any device
(`apply_token_bitmask_torch`, also the tests' reference). On a 2-core CPU at 64 x 49152 float32
logits the library's kernel took 7-15 ms and the torch ops 15-40 ms (benchmarks/NOTES.md).
"""

from __future__ import annotations

import importlib.util
import sys

import torch

# Bit j of an int32 word as an int32 (bit 31 wraps to the sign bit, -2**31), per device: made there,
# so unpacking on an accelerator copies nothing from the host.
_BIT_VALUES: dict[torch.device, torch.Tensor] = {}


def _bit_values(device: torch.device) -> torch.Tensor:
    values = _BIT_VALUES.get(device)
    if values is None:
        ones = torch.ones(32, dtype=torch.int32, device=device)
        values = _BIT_VALUES[device] = ones.bitwise_left_shift(torch.arange(32, dtype=torch.int32, device=device))
    return values


def num_bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_token_bitmask(num_rows: int, vocab_size: int, *, pin_memory: bool = False) -> torch.Tensor:
    """(num_rows, ceil(vocab_size / 32)) int32 on the CPU, every token allowed; `pin_memory` for a
    bitmask that is copied to a CUDA device."""
    return torch.full((num_rows, num_bitmask_words(vocab_size)), -1, dtype=torch.int32, pin_memory=pin_memory)


def bitmask_to_allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(R, W) int32 packed -> (R, vocab_size) bool: True where the token is allowed."""
    bits = (bitmask.unsqueeze(-1) & _bit_values(bitmask.device)) != 0  # (R, W, 32)
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size]


def _check(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    if logits.dim() != 2 or bitmask.dim() != 2 or rows.dim() != 1:
        raise ValueError(f"expected logits (N, V), bitmask (R, W), rows (R,); got {tuple(logits.shape)}, "
                         f"{tuple(bitmask.shape)}, {tuple(rows.shape)}")
    if bitmask.dtype != torch.int32 or rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"bitmask must be int32 and rows int32/int64; got {bitmask.dtype}, {rows.dtype}")
    if bitmask.shape[0] != rows.shape[0] or bitmask.shape[1] * 32 < logits.shape[1]:
        raise ValueError(f"a bitmask of {tuple(bitmask.shape)} with {rows.shape[0]} rows cannot mask logits "
                         f"{tuple(logits.shape)}")
    if not (bitmask.device == logits.device == rows.device):
        raise ValueError(f"logits, bitmask and rows must share a device; got {logits.device}, {bitmask.device}, "
                         f"{rows.device}")


def apply_token_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Set logits[rows[i], t] to -inf wherever bitmask[i] disallows token t, in torch ops."""
    allowed = bitmask_to_allowed(bitmask, logits.shape[1])  # (R, V)
    if rows.shape[0] == logits.shape[0] and rows.device.type == "cpu" and rows.tolist() == list(range(len(rows))):
        logits.masked_fill_(~allowed, float("-inf"))  # every row, in order: no gather and scatter
        return
    index = rows.long()
    picked = logits.index_select(0, index)  # (R, V)
    picked.masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, index, picked)


def _library_kernel(logits: torch.Tensor):
    """The grammar library's apply function where it runs for these logits, else None. The library is
    taken only if already imported: a bitmask exists only when a grammar was compiled, which imports it."""
    xgr = sys.modules.get("xgrammar")
    if xgr is None:
        return None
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return xgr.apply_token_bitmask_inplace
    if logits.device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        return xgr.apply_token_bitmask_inplace
    return None


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Mask the constrained rows of `logits` in place: logits (N, V) float; bitmask (R, W) int32 and
    rows (R,) int32/int64 (distinct logits row indices), all on logits' device. Each disallowed
    token's logit becomes -inf; rows not in `rows` are not touched."""
    _check(logits, bitmask, rows)
    if rows.shape[0] == 0:
        return
    kernel = _library_kernel(logits)
    if kernel is None:
        apply_token_bitmask_torch(logits, bitmask, rows)
        return
    # The kernel reads bitmask row r for logits row r: spread the constrained rows into a full-height
    # bitmask (N x W int32 words, a small fraction of the logits' N x V) and name the rows to touch.
    full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32, device=logits.device)
    full.index_copy_(0, rows.long(), bitmask)
    kernel(logits, full, vocab_size=logits.shape[1], indices=rows if logits.device.type == "cuda" else rows.tolist())
