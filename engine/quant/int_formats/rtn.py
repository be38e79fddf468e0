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


def quantize_int8_per_channel(weight: torch.Tensor, scale_dtype: torch.dtype = torch.float32) -> IntWeight:
    """(N, K) float -> symmetric int8 with (N, 1) scales in scale_dtype (codes rounded with those scales)."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=torch.finfo(scale_dtype).tiny)  # (N, 1)
    scale = scale.to(scale_dtype).float()
    q = torch.round(w / scale).clamp(-127, 127)
    codes = (q + 128).to(torch.uint8)
    return IntWeight(qweight=codes, scales=scale.to(scale_dtype), zeros=None, group_size=w.shape[1], bits=8)


def quantize_int4_groups(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE,
                         scale_dtype: torch.dtype = torch.float32) -> IntWeight:
    """(N, K) float -> asymmetric int4 with (N, G) scales in scale_dtype and zero points, G = ceil(K / group_size)."""
    w = weight.detach().float()
    n, k = w.shape
    num_groups = -(-k // group_size)
    padded = torch.nn.functional.pad(w, (0, num_groups * group_size - k))  # pad with 0: min <= 0 <= max anyway
    groups = padded.reshape(n, num_groups, group_size)
    # Include 0 in every group's range so zero-padding never widens it and 0 stays representable.
    lo = groups.amin(dim=2).clamp(max=0)
    hi = groups.amax(dim=2).clamp(min=0)
    scale = ((hi - lo) / 15.0).clamp(min=torch.finfo(scale_dtype).tiny)  # (N, G)
    scale = scale.to(scale_dtype).float()  # codes are rounded with the scales as stored
    zero = torch.round(-lo / scale).clamp(0, 15)  # (N, G)
    q = torch.round(groups / scale[..., None]) + zero[..., None]
    codes = q.clamp(0, 15).reshape(n, -1)[:, :k].to(torch.uint8)
    return IntWeight(qweight=codes.contiguous(), scales=scale.to(scale_dtype), zeros=zero.to(torch.int16),
                     group_size=group_size, bits=4)
