"""Block Hadamard rotation of a linear layer's input columns: int4's incoherence step.

A weight's group of 128 columns is quantized on one range, so one large weight in it coarsens the
grid for the other 127. Rotating the columns by an orthogonal R (W -> W R, x -> x R: exact in
float, since (x R)(W R)^T = x W^T) spreads such outliers over many columns, as QuaRot / QuIP#'s
incoherence processing does. R here is block-diagonal with one Sylvester Hadamard block of
HADAMARD_SIZE (entries +-1/8, symmetric, its own inverse) per 64 columns: two blocks per group of
128, nothing stored per layer, and at run time one (T, K/64, 64) x (64, 64) product: 64 multiply-
adds per input value, against the N the layer's own matmul spends on it.
"""

from __future__ import annotations

from functools import cache

import torch

HADAMARD_SIZE = 64


@cache
def hadamard_matrix(size: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    """(size, size) Sylvester Hadamard matrix / sqrt(size): orthogonal and symmetric; size a power of 2."""
    if size < 1 or size & (size - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power-of-2 size, not {size}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return (h / size ** 0.5).to(dtype=dtype, device=device)


def can_rotate(in_features: int, size: int = HADAMARD_SIZE) -> bool:
    return in_features % size == 0


def block_hadamard(x: torch.Tensor, size: int = HADAMARD_SIZE) -> torch.Tensor:
    """x (..., K) -> x R, R block-diagonal with K / size Hadamard blocks; its own inverse (R R = I)."""
    *lead, k = x.shape
    h = hadamard_matrix(size, x.dtype, str(x.device))
    return (x.reshape(-1, k // size, size) @ h).reshape(*lead, k)
