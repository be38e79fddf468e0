"""The post-norm decoder block (OLMo 2): the attention and MLP outputs are normed, not their inputs."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from batchgen.engine.models.layers.attention import Attention
from batchgen.engine.models.layers.mlp import GatedMLP
from batchgen.engine.models.layers.norm import RMSNorm

if TYPE_CHECKING:
    from types import SimpleNamespace

    from batchgen.engine.attention.base import AttentionBackend, AttentionMetadata
    from batchgen.engine.models.config import ModelConfig
    from batchgen.engine.parallel.group import TensorParallelGroup


class PostNormDecoderLayer(nn.Module):
    """HF's Olmo2DecoderLayer: h = x + norm(attn(x)); out = h + norm(mlp(h)), with no norm on either
    input (no `input_layernorm`; `post_attention_layernorm` norms the attention's output).

    It plugs into DecoderModel as a `layer_class` in place of decoder.py's DecoderLayer: the same
    constructor and `forward` contract, (output, residual stream) out, their sum the block's result.
    It is not a DecoderLayer subclass because that block builds an `input_layernorm`, which an OLMo 2
    checkpoint does not have (the loader refuses a parameter the checkpoint leaves unfilled).
    """

    def __init__(self, cfg: ModelConfig, layer_index: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                rope: tuple[torch.Tensor, torch.Tensor], backend: AttentionBackend, kv_cache: tuple,
                meta: AttentionMetadata, ops: SimpleNamespace,
                group: TensorParallelGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, hidden) output of the previous block and the residual stream (None before the first
        block) -> this block's (normed MLP output, residual stream); `group`: tensor parallelism's,
        or None."""
        x = hidden if residual is None else hidden + residual  # (T, hidden): this block's input
        attn = self.self_attn(x, rope, backend, kv_cache, meta, ops)
        if group is not None:
            group.all_reduce(attn)  # o_proj's partial sums over the ranks' heads
        norm = self.post_attention_layernorm
        x = x + ops.rms_norm(attn, norm.weight, norm.eps)
        out = self.mlp(x, ops)
        if group is not None:
            group.all_reduce(out)  # down_proj's partial sums over the ranks' MLP channels
        norm = self.post_feedforward_layernorm
        return ops.rms_norm(out, norm.weight, norm.eps), x
