"""Fp8Linear: a drop-in for nn.Linear whose weight is E4M3 with float32 scales.

Two matmul paths, chosen per module by `mode`:
- "w8a8": activations quantized per token (dynamic) or with a checkpoint's static input_scale, then
  one torch._scaled_mm (FP8 tensor cores on compute capability >= 8.9; it also runs on the CPU).
- "w8a16": weight-only; the E4M3 weight is widened to the activation dtype and the scale is applied
  to the output, (x @ q^T) * s == x @ (q * s)^T, which saves scaling N x K weight elements per call.
  On CUDA, where the Triton kernel passed its probe (fp8.py), the widening happens tile by tile in
  registers instead of in a full-size temporary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.engine.quant.fp8_tensor import (
    FP8_DTYPE,
    quantize_fp8,
    quantize_fp8_per_token,
    quantize_fp8_static,
)

FP8_MODES = ("w8a8", "w8a16")


class Fp8Linear(nn.Module):
    """y = x @ (q * scale)^T + bias; q (N, K) float8_e4m3fn, weight_scale (N,) per channel or (1,) per tensor."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 mode: str = "w8a16"):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.mode = mode
        self.use_triton = False  # w8a16 through batchgen.kernels.fp8_matmul (CUDA only; set by quantize_model_fp8)
        self.quantize_on_triton = False  # w8a8: the input quantized by kernels/fp8_quant.py (CUDA; likewise)
        # Parameters (not buffers) so the model's loader finds and shape-checks them like nn.Linear's.
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device),
                                 requires_grad=False) if bias else None
        # NaN until set: a scale a checkpoint failed to provide is caught after loading, not used.
        self.register_buffer("weight_scale", torch.full((out_features,), float("nan"), device=device))
        self.register_buffer("input_scale", None)  # () float32 static activation scale, checkpoints only

    @classmethod
    def from_linear(cls, linear: nn.Linear, layout: str = "channel", mode: str = "w8a16") -> Fp8Linear:
        """Quantize an nn.Linear's weight (bias kept in its dtype)."""
        w = linear.weight.detach()
        module = cls(linear.in_features, linear.out_features, linear.bias is not None,
                     dtype=w.dtype, device=w.device, mode=mode)
        q, scale = quantize_fp8(w, layout)
        module.weight.data = q
        module.weight_scale = scale
        if linear.bias is not None:
            module.bias.data = linear.bias.detach().clone()
        return module

    @property
    def is_per_tensor(self) -> bool:
        return self.weight_scale.numel() == 1

    @property
    def can_use_scaled_mm(self) -> bool:
        # cuBLASLt / CUTLASS FP8 GEMMs need K and N divisible by 16; the CPU has no such rule.
        return self.weight.device.type != "cuda" or (self.in_features % 16 == 0 and self.out_features % 16 == 0)

    def set_mode(self, mode: str) -> None:
        if mode not in FP8_MODES:
            raise ValueError(f"fp8 mode must be one of {', '.join(FP8_MODES)}; got {mode!r}")
        self.mode = mode if mode == "w8a16" or self.can_use_scaled_mm else "w8a16"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # (M, K)
        y = self._forward_w8a8(x2) if self.mode == "w8a8" else self._forward_w8a16(x2)  # (M, N)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def _forward_w8a16(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_triton:
            from batchgen.kernels.fp8_matmul import fp8_w8a16_matmul

            return fp8_w8a16_matmul(x, self.weight, self.weight_scale)
        # E4M3 values are exact in bf16/fp16/fp32, so the widening cast loses nothing.
        return F.linear(x, self.weight.to(x.dtype)) * self.weight_scale.to(x.dtype)

    def _quantize_per_token(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.quantize_on_triton and x.stride(-1) == 1:
            from batchgen.kernels.fp8_quant import quantize_fp8_per_token_triton

            return quantize_fp8_per_token_triton(x)  # one launch instead of eight
        return quantize_fp8_per_token(x)

    def _forward_w8a8(self, x: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        if self.input_scale is not None:
            x_q = quantize_fp8_static(x, self.input_scale)
            x_scale = self.input_scale.float().reshape(1, 1).expand(num_tokens, 1).contiguous()  # (M, 1)
        else:
            x_q, x_scale = self._quantize_per_token(x)  # (M, K) E4M3, (M, 1)
        if self.is_per_tensor:
            w_scale = self.weight_scale.expand(self.out_features).reshape(1, -1).contiguous()  # (1, N)
        else:
            w_scale = self.weight_scale.view(1, -1)  # (1, N)
        # _scaled_mm wants A row-major (M, K) and B column-major (K, N): q.t() of the row-major (N, K)
        # weight is exactly that, with no copy. CUDA's rowwise-scaled kernel writes bfloat16 only.
        out_dtype = torch.bfloat16 if x.is_cuda else x.dtype
        y = torch._scaled_mm(x_q, self.weight.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=out_dtype)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        layout = "per-tensor" if self.is_per_tensor else "per-channel"
        static = ", static input_scale" if self.input_scale is not None else ""
        static += ", triton" if self.use_triton and self.mode == "w8a16" else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {layout}, mode={self.mode}{static}")
