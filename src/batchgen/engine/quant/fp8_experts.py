"""FP8 experts at load (`quantization: fp8` on a mixture-of-experts model, as vLLM quantizes them): every
routed expert's gate_up and down weights to E4M3 with one float32 scale per (expert, output channel);
the router, a shared expert's gate and the biases stay in the model dtype (the shared expert's linear
layers are quantized as every other linear layer is, quant/fp8.py).

The experts then compute weight-only (w8a16, whatever fp8_mode the linear layers use): on the CPU each
expert's weights are widened as its rows are projected (`Fp8ExpertStack`, read by
kernels/fused_moe.fused_moe_torch: one expert at a time, never the whole stack), on CUDA the Triton fused
MoE kernel reads the E4M3 codes and applies the scales to its accumulators
(kernels/triton_fused_moe.py). Half the bytes of bf16 experts (a quarter of float32), scales aside.
"""

from __future__ import annotations

import torch
from torch import nn

from batchgen.engine.quant.fp8_tensor import FP8_MAX, MIN_SCALE, cast_to_fp8


def quantize_expert_stack(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E, N, K) -> (codes (E, N, K) float8_e4m3fn, scales (E, N) float32): per (expert, output row), the
    row's largest magnitude mapped onto 448."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=2) / FP8_MAX).clamp(min=MIN_SCALE)  # (E, N)
    return cast_to_fp8(w / scales[:, :, None]), scales


class Fp8ExpertStack:
    """An (E, N, K) expert weight stack held as E4M3 codes and (E, N) scales, indexed like the tensor it
    replaces: `stack[e]` is expert e's (N, K) weight widened to `dtype` (the product in float32)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype):
        self.codes, self.scales, self.dtype = codes, scales, dtype

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def __getitem__(self, expert: int) -> torch.Tensor:
        return (self.codes[expert].float() * self.scales[expert][:, None]).to(self.dtype)


def quantize_experts_fp8(model: nn.Module) -> tuple[int, int, int]:
    """Every Experts module's weight stacks to FP8 in place (layers/moe.Experts.quantize_fp8).
    Returns (modules quantized, float bytes before, FP8 bytes after with the scales).

    Experts modules are found by their `quantize_fp8` method, not their class: layers/moe.py imports this
    module, so importing it back here would make a cycle."""
    count = float_bytes = fp8_bytes = 0
    for module in model.modules():
        if callable(getattr(module, "quantize_fp8", None)) and not module.is_fp8 and module.packed is None:
            before, after = module.quantize_fp8()
            count, float_bytes, fp8_bytes = count + 1, float_bytes + before, fp8_bytes + after
    return count, float_bytes, fp8_bytes

