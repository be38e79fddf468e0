"""The sandwich-norm decoder block (GLM-4): the pre-norm block with its attention and MLP outputs
normed too, before their residual adds."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from batchgen.engine.models.layers.decoder import DecoderLayer
from batchgen.engine.models.layers.norm import RMSNorm

if TYPE_CHECKING:
    from types import SimpleNamespace

    from batchgen.engine.models.config import ModelConfig


class SandwichNormDecoderLayer(DecoderLayer):
    """GLM-4's block: the pre-norm block with the attention and MLP outputs normed too before their
    residual adds: h = x + post_self_attn_norm(attn(norm(x))); out = h + post_mlp_norm(mlp(norm(h))).

    DecoderLayer's forward with its two output hooks norming (whole sums, after tensor parallelism's
    all-reduce); it returns the normed MLP output and the residual stream apart. The names
    are GLM's checkpoint names (its `post_attention_layernorm` is the MLP's pre-norm, as Llama's).
    """

    def __init__(self, cfg: ModelConfig, layer_index: int):
        super().__init__(cfg, layer_index)
        self.post_self_attn_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_mlp_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def attention_output(self, x: torch.Tensor, ops: SimpleNamespace) -> torch.Tensor:
        norm = self.post_self_attn_layernorm
        return ops.rms_norm(x, norm.weight, norm.eps)

    def mlp_output(self, hidden: torch.Tensor, ops: SimpleNamespace) -> torch.Tensor:
        norm = self.post_mlp_layernorm
        return ops.rms_norm(hidden, norm.weight, norm.eps)
