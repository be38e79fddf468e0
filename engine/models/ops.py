"""The model's elementwise pieces: eager torch, fused C kernels on the CPU in float32, or fused by
torch.compile (`engine.compile: true`).

Linear layers stay ordinary modules (so FP8 can swap them); what fusing buys is one pass for each
memory-bound step around them: residual add + RMSNorm, rotary on q and k, SiLU(gate) * up.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        # One fused op; in float32 it computes HF's expression below bit for bit (checked in tests).
        return F.rms_norm(x, weight.shape, weight, eps)
    # HF's op order (normalize in float32, scale in the model dtype), for matching logits.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual)."""
    total = x + residual
    return rms_norm(total, weight, eps), total


def rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half rotary, x * cos + rotate_half(x) * sin, as x * cos + swap_halves(x) * signed_sin
    (signed_sin = sin with its first half negated): two passes fewer. x: (T, heads, D); cos,
    signed_sin: (T, 1, D). q and k go through together as one (T, H + Hkv, D) tensor."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


_NAMES = ("rms_norm", "add_rms_norm", "rotary", "silu_mul")


def eager_ops() -> SimpleNamespace:
    return SimpleNamespace(**{name: globals()[name] for name in _NAMES})


def compiled_ops() -> SimpleNamespace:
    """One compiled kernel per op for every layer (tensors are arguments, so no per-layer recompiles)."""
    return SimpleNamespace(**{name: torch.compile(globals()[name], dynamic=True) for name in _NAMES})


def cpu_kernel_ops() -> SimpleNamespace:
    """The C kernels of kernels/cpu_elementwise.py (CPU, float32; rotary and the residual add work
    in place); norms of other shapes (Qwen3's per-head q/k norms) stay eager."""
    from batchgen.kernels import cpu_elementwise as fused

    def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return fused.rms_norm(x, weight, eps) if x.dim() == 2 else rms_norm(x, weight, eps)

    return SimpleNamespace(rms_norm=rms_norm_rows, add_rms_norm=fused.add_rms_norm, rotary=fused.rotary,
                           silu_mul=fused.silu_mul)
