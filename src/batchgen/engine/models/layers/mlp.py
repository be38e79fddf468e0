"""The gated MLP: down_proj(act(gate) * up), gate and up fused into one matmul; act is SiLU (SwiGLU)
or GeLU-tanh (Gemma's GeGLU)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from batchgen.kernels.reference import gelu_tanh_mul_ref

# config.json's hidden_act / hidden_activation names of GeLU with the tanh approximation.
GELU_TANH_NAMES = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new")

if TYPE_CHECKING:
    from types import SimpleNamespace

    from batchgen.engine.models.config import ModelConfig


class GatedMLP(nn.Module):
    """gate_up_proj (hidden -> 2 x intermediate, gate rows first) and down_proj, bias-free.

    On the CPU the loader may swap gate_up_proj for a layer that applies SiLU(gate) * up in its GEMMs'
    epilogues (models/cpu_linear.py, `applies_silu_mul`); the MLP then skips its own. A family with
    another activation (GeLU-tanh: Gemma) would take it as a parameter here and keep the fused layer
    out (pack_linears fuses SiLU only).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.is_gelu_tanh = cfg.hidden_act in GELU_TANH_NAMES

    def forward(self, x: torch.Tensor, ops: SimpleNamespace) -> torch.Tensor:
        """(T, hidden) -> (T, hidden); `ops`: the model's elementwise ops (../ops.py)."""
        if getattr(self.gate_up_proj, "applies_silu_mul", False):  # CPU: fused into the GEMMs' epilogues
            return self.down_proj(self.gate_up_proj(x))
        # (T, 2 x intermediate) -> (T, intermediate) -> (T, hidden)
        if self.is_gelu_tanh:  # eager on every path: the fused C / oneDNN forms are SiLU's
            return self.down_proj(gelu_tanh_mul_ref(self.gate_up_proj(x)))
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x)))

