"""The sandwich-norm decoder block (GLM-4): the pre-norm block with its attention and MLP outputs
normed too, before their residual adds."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from batchgen.engine.models.layers.decoder import DecoderLayer
from batchgen.engine.models.layers.norm import RMSNorm

if TYPE_CHECKING:
    from types import SimpleNamespace

    from batchgen.engine.attention.base import AttentionBackend, AttentionMetadata
    from batchgen.engine.models.config import ModelConfig
    from batchgen.engine.parallel.group import TensorParallelGroup


class SandwichNormDecoderLayer(DecoderLayer):
    """GLM-4's block: the pre-norm block with the attention and MLP outputs normed too before their
    residual adds: h = x + post_self_attn_norm(attn(norm(x))); out = h + post_mlp_norm(mlp(norm(h))).

    It returns the normed MLP output and the residual stream apart, as DecoderLayer does. The names
    are GLM's checkpoint names (its `post_attention_layernorm` is the MLP's pre-norm, as Llama's).
    """

    def __init__(self, cfg: ModelConfig, layer_index: int):
        super().__init__(cfg, layer_index)
        self.post_self_attn_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_mlp_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                rope: tuple[torch.Tensor, torch.Tensor], backend: AttentionBackend, kv_cache: tuple,
                meta: AttentionMetadata, ops: SimpleNamespace,
                group: TensorParallelGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
        """As DecoderLayer.forward; the post-norms act on whole sums (after tensor parallelism's all-reduce)."""
        norm = self.input_layernorm
        if residual is None:
            residual = hidden
            x = ops.rms_norm(hidden, norm.weight, norm.eps)
        else:
            x, residual = ops.add_rms_norm(hidden, residual, norm.weight, norm.eps)
        x = self.self_attn(x, rope, backend, kv_cache, meta, ops)  # (T, hidden)
        if group is not None:
            group.all_reduce(x)
        norm = self.post_self_attn_layernorm
        x = ops.rms_norm(x, norm.weight, norm.eps)
        norm = self.post_attention_layernorm
        x, residual = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        hidden = self.mlp(x, ops)  # (T, hidden)
        if group is not None:
            group.all_reduce(hidden)
        norm = self.post_mlp_layernorm
        return ops.rms_norm(hidden, norm.weight, norm.eps), residual
