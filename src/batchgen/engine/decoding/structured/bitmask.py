"""Packed token bitmasks: allocate, unpack, and apply to the constrained rows of a logits tensor in place.

A bitmask row is ceil(V / 32) int32 words; bit j of word w (two's complement, little-endian bit
order) allows token 32w + j. Only constrained rows have a bitmask row: `rows` says which logits row
each one masks, and every other logits row is left exactly as it was.

On CPU logits the apply is a C kernel (kernels/cpu_token_bitmask.py: one pass over the words,
in place); elsewhere, or without a compiler, torch ops that run on any device. Measured at 64 x 49152
float32 logits with the masks of a real JSON walk on the shared 2-core CPU
(docs/benchmarks/history/structured-output.md, "Structured output"): the torch ops 7-12 ms per step,
xgrammar's C++ kernel 19 ms (it tests token by token), llguidance's torch.compile of the same ops 0.7 ms (one
fused pass, compiled to C++ through inductor at run time, which the engine does not do by default).
"""

from __future__ import annotations

import torch

from batchgen.kernels import cpu_token_bitmask

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


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Mask the constrained rows of `logits` in place: logits (N, V) float; bitmask (R, W) int32 and
    rows (R,) int32/int64 (distinct logits row indices), all on logits' device. Each disallowed
    token's logit becomes -inf; rows not in `rows` are not touched. Nothing is read back to the host
    and nothing copied to the device."""
    _check(logits, bitmask, rows)
    if rows.shape[0] == 0:
        return
    if cpu_token_bitmask.can_apply(logits) and cpu_token_bitmask.is_available():
        cpu_token_bitmask.apply_token_bitmask(logits, bitmask, rows)
        return
    apply_token_bitmask_torch(logits, bitmask, rows)


def apply_token_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """apply_token_bitmask in torch ops alone (any device; the CPU kernel's reference)."""
    _check(logits, bitmask, rows)
    if rows.shape[0] == 0:
        return
    allowed = bitmask_to_allowed(bitmask, logits.shape[1])  # (R, V)
    if rows.shape[0] == logits.shape[0] and rows.device.type == "cpu" and rows.tolist() == list(range(len(rows))):
        logits.masked_fill_(~allowed, float("-inf"))  # every row, in order: no gather and scatter
        return
    index = rows.long()
    picked = logits.index_select(0, index)  # (R, V)
    picked.masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, index, picked)
