"""Quantize a float weight at load, round-to-nearest (no calibration data): the `int8` and `int4` choices.

- int8: symmetric, one scale per output channel, s = max|w| / 127, q = round(w / s) in [-127, 127]
  (the runtime kernels read signed int8 directly: torch's int8 weight-only matmul takes exactly this).
- int4: asymmetric, groups of 128 input columns (the last one shorter when K is not a multiple),
  s = (max - min) / 15, z = round(-min / s) in [0, 15], q = clamp(round(w / s) + z, 0, 15).
"""

from __future__ import annotations

import torch

from batchgen.engine.quant.int_formats.int_weight import IntWeight

INT4_GROUP_SIZE = 128


def int8_channel_grid(weight: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> (q (N, K) float32 codes in [-127, 127], scale (N, 1) float32 as stored in scale_dtype)."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=torch.finfo(scale_dtype).tiny)  # (N, 1)
    scale = scale.to(scale_dtype).float()
    return torch.round(w / scale).clamp(-127, 127), scale


def quantize_int8_per_channel(weight: torch.Tensor, scale_dtype: torch.dtype = torch.float32) -> IntWeight:
    """(N, K) float -> symmetric int8 with (N, 1) scales in scale_dtype (codes rounded with those scales)."""
    q, scale = int8_channel_grid(weight, scale_dtype)
    codes = (q + 128).to(torch.uint8)
    return IntWeight(qweight=codes, scales=scale.to(scale_dtype), zeros=None, group_size=q.shape[1], bits=8)


def int8_fake_quantized(weight: torch.Tensor, scale_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(N, K) float32: quantize_int8_per_channel(weight).dequantize() without building the IntWeight."""
    q, scale = int8_channel_grid(weight, scale_dtype)
    return q * scale


def quantize_int4_groups(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE,
                         scale_dtype: torch.dtype = torch.float32) -> IntWeight:
    """(N, K) float -> asymmetric int4 with (N, G) scales in scale_dtype and zero points, G = ceil(K / group_size)."""
    w = weight.detach().float()
    return int4_from_ranges(w, *int4_group_ranges(w, group_size), group_size, scale_dtype)


def int4_group_ranges(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's (min, max), both (N, G) float32, widened to hold 0 (so zero-padding never widens
    a range and 0 stays representable)."""
    groups = padded_groups(weight, group_size)
    return groups.amin(dim=2).clamp(max=0), groups.amax(dim=2).clamp(min=0)


def padded_groups(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N, K) -> (N, G, group_size) float32, the last group padded with zeros."""
    n, k = weight.shape
    num_groups = -(-k // group_size)
    return torch.nn.functional.pad(weight.float(), (0, num_groups * group_size - k)).reshape(n, num_groups, group_size)


def int4_group_grid(weight: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, group_size: int,
                    scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The codes of `weight` on each group's grid over [lo, hi] ((N, G) each, lo <= 0 <= hi); values
    outside a range clamp to its ends (the clipping search passes shrunk ranges).
    Returns q (N, G, group_size) float32 codes in 0..15 (padding included), scale and zero (N, G) float32."""
    groups = padded_groups(weight, group_size)
    scale = ((hi - lo) / 15.0).clamp(min=torch.finfo(scale_dtype).tiny)  # (N, G)
    scale = scale.to(scale_dtype).float()  # codes are rounded with the scales as stored
    zero = torch.round(-lo / scale).clamp(0, 15)  # (N, G)
    q = (torch.round(groups / scale[..., None]) + zero[..., None]).clamp(0, 15)
    return q, scale, zero


def int4_from_ranges(weight: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, group_size: int,
                     scale_dtype: torch.dtype = torch.float32) -> IntWeight:
    """(N, K) float -> asymmetric int4 on the grids of int4_group_grid."""
    n, k = weight.shape
    q, scale, zero = int4_group_grid(weight, lo, hi, group_size, scale_dtype)
    codes = q.reshape(n, -1)[:, :k].to(torch.uint8)
    return IntWeight(qweight=codes.contiguous(), scales=scale.to(scale_dtype), zeros=zero.to(torch.int16),
                     group_size=group_size, bits=4)


def int4_fake_quantized_groups(weight: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, group_size: int,
                               scale_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(N, G, group_size) float32: int4_from_ranges(...).dequantize() per group, padding included
    (dequantized padding is 0: zero-padding maps to the zero point)."""
    q, scale, zero = int4_group_grid(weight, lo, hi, group_size, scale_dtype)
    return (q - zero[..., None]) * scale[..., None]
