"""A packed token bitmask applied to rows of the step's logits on the CPU in one C pass (csrc/token_bitmask.c).

The torch version (engine/decoding/structured/bitmask.py) unpacks the (R, V / 32) int32 words into an (R, V)
boolean tensor, then masks through a gather and a scatter of the rows: several passes and
allocations of the row size. This kernel reads each word once, skips all-allowed words and writes
-inf only where a token is not allowed, in place. Built on first use (kernels/c_library.py); without
a compiler the torch version runs.
"""

from __future__ import annotations

import ctypes

import torch

from batchgen.kernels.c_library import CLibrary

_LIBRARY = CLibrary("token_bitmask", ("token_bitmask.c",), {
    "apply_token_bitmask": (None, [ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                   ctypes.c_void_p, ctypes.c_int]),
}, fallback="the token bitmask applied with torch ops")


def is_available() -> bool:
    """True once the kernel is built (or found in the cache) and loaded."""
    return _LIBRARY.is_available()


def can_apply(logits: torch.Tensor) -> bool:
    """The kernel takes (N, V) float32 CPU logits with contiguous rows."""
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.stride(-1) == 1)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """logits (N, V) float32 CPU, edited in place; bitmask (R, W) int32 CPU, rows contiguous; rows (R,)
    int32/int64 CPU, distinct indices into logits' rows (the caller checks them)."""
    if not can_apply(logits):
        raise ValueError(f"expected (N, V) float32 CPU logits with contiguous rows, got {logits.dtype} "
                         f"{tuple(logits.shape)} on {logits.device}")
    bitmask = bitmask.contiguous()
    rows64 = rows.to(torch.int64).contiguous()
    _LIBRARY.require().apply_token_bitmask(logits.data_ptr(), logits.stride(0), logits.shape[1], bitmask.data_ptr(),
                                           bitmask.shape[1], rows64.data_ptr(), rows64.shape[0])
