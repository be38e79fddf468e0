"""Self-attention: fused q/k/v projection, optional q/k RMSNorm (per head or over all heads), rope, the
backend's call, o_proj."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from batchgen.engine.attention.base import WindowedMetadata
from batchgen.engine.models.layers.norm import RMSNorm

if TYPE_CHECKING:
    from types import SimpleNamespace

    from batchgen.engine.attention.base import AttentionBackend, AttentionMetadata
    from batchgen.engine.models.config import ModelConfig
    from batchgen.engine.parallel.group import TensorParallelGroup


class Attention(nn.Module):
    """One layer's attention. The backend (engine/attention/, chosen by the loader) writes this
    layer's k/v into the paged KV cache and attends over it; `layer_index` names the layer to it.

    From the config: `attention_bias` (bias on q/k/v: Qwen2, GLM-4), `qk_norm` (RMSNorm on every q
    and k head before rope: Qwen3), `qk_norm_over_heads` (that RMSNorm over the whole q and the whole k
    projection instead, one statistic per token across heads: OLMo 2), `o_proj_bias` (OLMo 2 with
    attention_bias), `partial_rotary_factor` (rope on the first channels of each head: GLM-4,
    Phi-4-mini), `rope_interleaved` (rope on adjacent pairs: GLM-4, whose tables span the whole head) and
    `attention_sinks` (gpt-oss: `sinks` (H,), one logit per query head, handed to the backend).
    """

    def __init__(self, cfg: ModelConfig, layer_index: int):
        super().__init__()
        self.cfg = cfg
        self.layer_index = layer_index
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.rotary_op = "rotary_interleaved" if cfg.rope_interleaved else "rotary"  # the name in `ops`
        if cfg.qk_norm:
            over_heads = cfg.qk_norm_over_heads
            self.q_norm = RMSNorm(cfg.q_size if over_heads else cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.kv_size if over_heads else cfg.head_dim, cfg.rms_norm_eps)
        # Tensor parallelism with norms over all heads: the group that sums the ranks' squares, and the
        # whole model's q and k widths (set_qk_norm_group); None: this rank's q and k are whole.
        self.qk_norm_group: TensorParallelGroup | None = None
        self.qk_norm_widths = (cfg.q_size, cfg.kv_size)
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads)) if cfg.attention_sinks else None

    def set_qk_norm_group(self, group: TensorParallelGroup, q_width: int, kv_width: int) -> None:
        """Tensor parallelism (qk_norm_over_heads): this rank holds a slice of q and of k (and of their
        norm weights); each token's mean square is summed over the ranks' slices, `q_width` and
        `kv_width` wide in all (the whole model's q_size and kv_size)."""
        self.qk_norm_group = group
        self.qk_norm_widths = (q_width, kv_width)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], backend: AttentionBackend,
                kv_cache: tuple, meta: AttentionMetadata, ops: SimpleNamespace) -> torch.Tensor:
        """(T, hidden) normed -> (T, hidden) before the residual add; `rope`: the step's cos, sin
        (T, 1, rotary_dim)."""
        cfg = self.cfg
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # (T, q_size + 2 * kv_size)
        num_qk_heads = cfg.num_heads + cfg.num_kv_heads
        qk = qkv[:, :cfg.q_size + cfg.kv_size].view(num_tokens, num_qk_heads, cfg.head_dim)
        v = qkv[:, cfg.q_size + cfg.kv_size:].view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm and cfg.qk_norm_over_heads:
            # One mean square per token over all of q (and of k): the norms see the (T, q_size) and
            # (T, kv_size) blocks of the fused output as rows (strided views, no copy).
            q, k = qkv[:, :cfg.q_size], qkv[:, cfg.q_size:cfg.q_size + cfg.kv_size]
            if self.qk_norm_group is not None:
                qk = self._split_qk_norm(q, k).view(num_tokens, num_qk_heads, cfg.head_dim)
            else:
                qk = torch.cat([ops.rms_norm(q, self.q_norm.weight, self.q_norm.eps),
                                ops.rms_norm(k, self.k_norm.weight, self.k_norm.eps)],
                               dim=1).view(num_tokens, num_qk_heads, cfg.head_dim)
        elif cfg.qk_norm:
            q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
            qk = torch.cat([ops.rms_norm(q, self.q_norm.weight, self.q_norm.eps),
                            ops.rms_norm(k, self.k_norm.weight, self.k_norm.eps)], dim=1)
        rotary_dim = cfg.rotary_dim
        if cfg.rope_interleaved or rotary_dim == cfg.head_dim:  # interleaved tables span the whole head
            qk = getattr(ops, self.rotary_op)(qk, *rope)
        else:  # partial rotary: the first rotary_dim channels of each head turn, the rest pass as they are
            # (contiguous: the C kernel takes whole heads)
            turned = ops.rotary(qk[..., :rotary_dim].contiguous(), *rope)  # (T, H + Hkv, rotary_dim)
            qk = torch.cat([turned, qk[..., rotary_dim:]], dim=-1)
        q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)  # (T, H, D), (T, Hkv, D)
        if isinstance(meta, WindowedMetadata):  # a local layer reads its own group's tables
            meta = meta.for_layer(backend.layer(self.layer_index))
        if self.sinks is None:
            out = backend.forward(self.layer_index, q, k, v, kv_cache, meta)  # (T, H, D)
        else:
            out = backend.forward(self.layer_index, q, k, v, kv_cache, meta, sinks=self.sinks)
        return self.o_proj(out.reshape(num_tokens, cfg.q_size))

    def _split_qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """(T, q slice), (T, k slice) -> (T, q slice + k slice) normed over the whole q and the whole k: the
        ranks' float32 sums of squares (one all-reduce of (T, 2)), then HF's RMSNorm arithmetic
        (x * rsqrt(mean + eps) in float32, times the weight, back to x's dtype)."""
        qf, kf = q.float(), k.float()
        squares = torch.stack([qf.pow(2).sum(-1), kf.pow(2).sum(-1)], dim=-1)  # (T, 2)
        self.qk_norm_group.all_reduce(squares)
        q_width, kv_width = self.qk_norm_widths
        q_out = self.q_norm.weight.float() * (qf * torch.rsqrt(squares[:, :1] / q_width + self.q_norm.eps))
        k_out = self.k_norm.weight.float() * (kf * torch.rsqrt(squares[:, 1:] / kv_width + self.k_norm.eps))
        return torch.cat([q_out, k_out], dim=1).to(q.dtype)
