"""The model's elementwise pieces, eager or fused by torch.compile (`engine.compile: true`).

Linear layers stay ordinary modules (so FP8 can swap them); what compiling buys is fusing the
memory-bound passes around them: residual add + RMSNorm, rotary on q and k, SiLU(gate) * up.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # HF's op order (normalize in float32, scale in the model dtype), for matching logits.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual)."""
    total = x + residual
    return rms_norm(total, weight, eps), total


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # q: (T, H, D); k: (T, Hkv, D); cos, sin: (T, 1, D), rotate-half layout
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


_NAMES = ("rms_norm", "add_rms_norm", "rotary", "silu_mul")


def eager_ops() -> SimpleNamespace:
    return SimpleNamespace(**{name: globals()[name] for name in _NAMES})


def compiled_ops() -> SimpleNamespace:
    """One compiled kernel per op for every layer (tensors are arguments, so no per-layer recompiles)."""
    return SimpleNamespace(**{name: torch.compile(globals()[name], dynamic=True) for name in _NAMES})
