"""Pure-torch references of the Triton kernels in this package (the tests compare each kernel to these)."""

from __future__ import annotations

import torch


def fp8_w8a16_matmul_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (M, K), weight (N, K) float8_e4m3fn, scale (N,) or (1,) float32 -> (M, N) in x's dtype.

    Accumulates in float32 like the kernel: (x @ q^T) * scale.
    """
    return ((x.float() @ weight.float().t()) * scale.float().reshape(1, -1)).to(x.dtype)
