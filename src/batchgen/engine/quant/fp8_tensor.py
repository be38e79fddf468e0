"""FP8 E4M3 quantize / dequantize for weights (per output channel or per tensor) and activations (per token).

E4M3 ("float8_e4m3fn": 4 exponent bits, 3 mantissa bits, no infinities) spans +-448 with a relative
rounding error of at most 2**-4 for normal values. A scale maps each group's largest magnitude onto
448 so the whole range is used: w ~= q * scale.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
# A group of zeros would get scale 0 and divide by it; any tiny positive scale maps them to 0 exactly.
MIN_SCALE = 1e-12
SCALE_LAYOUTS = ("channel", "tensor")


def quantize_fp8(weight: torch.Tensor, layout: str = "channel") -> tuple[torch.Tensor, torch.Tensor]:
    """weight (N, K) -> (q (N, K) float8_e4m3fn, scale float32: (N,) for "channel", (1,) for "tensor")."""
    if weight.dim() != 2:
        raise ValueError(f"expected a 2-D weight (out_features, in_features), got shape {tuple(weight.shape)}")
    w = weight.float()
    if layout == "channel":
        amax = w.abs().amax(dim=1)  # (N,)
    elif layout == "tensor":
        amax = w.abs().amax().reshape(1)  # (1,)
    else:
        raise ValueError(f"scale layout must be one of {', '.join(SCALE_LAYOUTS)}; got {layout!r}")
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    return cast_to_fp8(w / scale[:, None] if layout == "channel" else w / scale), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q (N, K) E4M3 and scale (N,) or (1,) -> (N, K) in dtype (the product taken in float32)."""
    return (q.float() * scale.float().reshape(-1, 1)).to(dtype)


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization: x (M, K) -> (q (M, K) E4M3, scale (M, 1) float32), one scale per row."""
    x32 = x.float()
    scale = (x32.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)  # (M, 1)
    return cast_to_fp8(x32 / scale), scale


def quantize_fp8_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Static activation quantization with a calibrated per-tensor scale (checkpoints' input_scale)."""
    return cast_to_fp8(x.float() / scale.float())


def cast_to_fp8(x: torch.Tensor) -> torch.Tensor:
    # The cast does not saturate: anything past 448 would become NaN, so clamp first.
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
