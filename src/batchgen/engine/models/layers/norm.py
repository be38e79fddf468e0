"""RMSNorm: the weight and eps a norm holds; the math is the model's elementwise ops (../ops.py)."""

from __future__ import annotations

import torch
from torch import nn

from batchgen.engine.models.ops import rms_norm


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dimension (HF's LlamaRMSNorm: computed in float32).

    The decoder's hot path reads `weight` and `eps` and calls the fused ops itself (residual add +
    norm in one pass); `forward` is the eager op, for the final norm on the sampled rows.
    """

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
