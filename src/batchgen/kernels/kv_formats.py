"""The KV cache's storage formats: FP8 (e4m3fn, e5m2) with one float32 scale per layer for K and V.

A cache of an FP8 dtype holds clamp(x / scale, -max, max) cast to that format (the clamp first:
e4m3fn has no infinity, an overflow would become NaN); a reader dequantizes code * scale. Shared by
the Triton kernels, the C kernels (through a 256-entry lookup table) and the references. Imports
only torch.
"""

from __future__ import annotations

import torch

# Cache dtypes stored quantized, with the largest finite value of each (the clamp bound).
FP8_KV_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
FP8_KV_DTYPES = tuple(FP8_KV_MAX)


def is_fp8_kv(dtype: torch.dtype) -> bool:
    """True when a cache of this dtype stores scaled FP8 values."""
    return dtype in FP8_KV_MAX


def fp8_code_values(dtype: torch.dtype) -> torch.Tensor:
    """(256,) float32: the value of every byte of this FP8 format (byte b -> its value; NaN codes stay NaN)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()


def quantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """x as an FP8 cache of `dtype` stores it: clamp(x / scale) to the format's finite range, cast.
    scale: one float32 value (any shape with one element), on x's device."""
    limit = FP8_KV_MAX[dtype]
    return (x.float() / scale.reshape(())).clamp_(-limit, limit).to(dtype)
