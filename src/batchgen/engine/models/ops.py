"""The model's elementwise pieces: eager torch, fused C kernels on the CPU in float32, or fused by
torch.compile.

Linear layers stay ordinary modules (so FP8 can swap them); what fusing buys is one pass for each
memory-bound step around them: residual add + RMSNorm, rotary on q and k, SiLU(gate) * up. The
eager ops are the kernels' torch references (kernels/reference.py), one definition of the math for
both the engine's fallback path and the kernels' tests.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from batchgen.kernels import reference

rms_norm = reference.rms_norm_ref
add_rms_norm = reference.add_rms_norm_ref
rotary = reference.rotary_ref
rotary_interleaved = reference.rotary_interleaved_ref
silu_mul = reference.silu_mul_ref

_NAMES = ("rms_norm", "add_rms_norm", "rotary", "rotary_interleaved", "silu_mul")


def eager_ops() -> SimpleNamespace:
    return SimpleNamespace(**{name: globals()[name] for name in _NAMES})


def compiled_ops() -> SimpleNamespace:
    """One compiled kernel per op for every layer (tensors are arguments, so no per-layer recompiles)."""
    return SimpleNamespace(**{name: torch.compile(globals()[name], dynamic=True) for name in _NAMES})


def cpu_kernel_ops() -> SimpleNamespace:
    """The C kernels of kernels/cpu_elementwise.py (CPU, float32; rotary and the residual add work
    in place); norms of other shapes (Qwen3's per-head q/k norms) and GLM's interleaved rotary stay eager."""
    from batchgen.kernels import cpu_elementwise as fused

    def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return fused.rms_norm(x, weight, eps) if x.dim() == 2 else rms_norm(x, weight, eps)

    return SimpleNamespace(rms_norm=rms_norm_rows, add_rms_norm=fused.add_rms_norm, rotary=fused.rotary,
                           rotary_interleaved=rotary_interleaved, silu_mul=fused.silu_mul)
