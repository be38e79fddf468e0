"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2) in plain torch over flat token batches.

A step's tokens from all sequences are one flat (T,) batch: no padding in the dense layers.
q/k/v and gate/up are fused into one matmul each; attention goes through the backend the loader
chose (engine/attention/), which writes and reads the paged KV cache.

Tensor parallelism (engine/parallel/): a rank's model is built from its own ModelConfig (its query
and KV heads, MLP channels and vocabulary rows: the layers are plain linear layers of those shapes,
whatever the loader swaps them for), and `forward` adds the collectives: the embedding's sum over the
ranks' vocabulary slices, one all-reduce after o_proj and one after down_proj (the row-parallel
layers' partial sums), and the logits' column slices gathered on rank 0.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from batchgen.engine.attention import AttentionBackend, AttentionMetadata
from batchgen.engine.models import ops as eager
from batchgen.engine.models.config import ModelConfig
from batchgen.engine.models.ops import compiled_ops, cpu_kernel_ops, eager_ops
from batchgen.engine.models.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from batchgen.engine.parallel import TensorParallel

# FP8 checkpoints' per-layer scales; quant/fp8_checkpoint.py places (or, for KV-cache scales, skips) them.
_FP8_SCALE_SUFFIXES = (".weight_scale", ".input_scale", ".output_scale", ".k_scale", ".v_scale")


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return eager.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int):
        super().__init__()
        self.cfg = cfg
        self.layer_index = layer_index
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], backend: AttentionBackend,
                kv_cache: tuple, meta: AttentionMetadata, ops) -> torch.Tensor:
        cfg = self.cfg
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # (T, q_size + 2 * kv_size)
        num_qk_heads = cfg.num_heads + cfg.num_kv_heads
        qk = qkv[:, :cfg.q_size + cfg.kv_size].view(num_tokens, num_qk_heads, cfg.head_dim)
        v = qkv[:, cfg.q_size + cfg.kv_size:].view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
            qk = torch.cat([ops.rms_norm(q, self.q_norm.weight, self.q_norm.eps),
                            ops.rms_norm(k, self.k_norm.weight, self.k_norm.eps)], dim=1)
        q, k = ops.rotary(qk, *rope).split([cfg.num_heads, cfg.num_kv_heads], dim=1)  # (T, H, D), (T, Hkv, D)
        out = backend.forward(self.layer_index, q, k, v, kv_cache, meta)  # (T, H, D)
        return self.o_proj(out.reshape(num_tokens, cfg.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        if getattr(self.gate_up_proj, "applies_silu_mul", False):  # CPU: fused into the GEMMs' epilogues
            return self.down_proj(self.gate_up_proj(x))
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


class LlamaForCausalLM(nn.Module):
    # HF checkpoint name -> (our parameter, slice index into the fused tensor or None)
    _FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: ModelConfig, max_positions: int, attention_backend: AttentionBackend,
                 parallel: TensorParallel | None = None):
        """`cfg`: the shapes of this model's modules; with `parallel`, the rank's (layout.rank_config)."""
        super().__init__()
        self.cfg = cfg
        self.parallel = parallel
        # The logits' width: the whole vocabulary (a rank's lm_head holds a slice of it).
        self.vocab_size = cfg.vocab_size if parallel is None else parallel.layout.vocab_size
        # No random init (the loader fills every weight): nn.Embedding's normal_ on the meta device
        # imports torch._dynamo, seconds of every process's load (each tensor-parallel rank's too).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.backend = attention_backend
        self.ops = eager_ops()

    def enable_compile(self) -> None:
        """Fuse the elementwise passes with torch.compile (compiles on first use, once per op)."""
        self.ops = compiled_ops()

    def enable_cpu_kernels(self) -> None:
        """Fused C elementwise kernels (CPU, float32): rotary and the residual add then work in place."""
        self.ops = cpu_kernel_ops()

    def tie_weights(self) -> None:
        # Re-run after to_empty()/to(): those make fresh tensors and would untie the pair.
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple],
                meta: AttentionMetadata, logits_indices: torch.Tensor,
                hidden_indices: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
        """input_ids, positions: (T,); returns logits (N, V) for the N rows in logits_indices only
        (tensor-parallel: see `logits` for what a worker gets), and with `hidden_indices` (R,) also those
        rows' normed final hidden states (R, H), whose logits the caller makes a slice at a time (prompt
        log-probabilities: `lm_head(rows).float()`; one process only)."""
        ops = self.ops
        group = self.parallel.group if self.parallel is not None else None
        hidden = self.embed(input_ids)  # (T, hidden)
        rope = self.rotary.lookup(positions, hidden.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            norm = layer.input_layernorm
            if residual is None:
                residual = hidden
                x = ops.rms_norm(hidden, norm.weight, norm.eps)
            else:
                x, residual = ops.add_rms_norm(hidden, residual, norm.weight, norm.eps)
            x = layer.self_attn(x, rope, self.backend, kv_cache, meta, ops)
            if group is not None:
                group.all_reduce(x)  # o_proj's partial sums over the ranks' heads
            norm = layer.post_attention_layernorm
            x, residual = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
            hidden = layer.mlp(x, ops)
            if group is not None:
                group.all_reduce(hidden)  # down_proj's partial sums over the ranks' MLP channels
        hidden = hidden + residual
        logits = self.logits(self.norm(hidden.index_select(0, logits_indices)))  # only rows that will be sampled
        if hidden_indices is None:
            return logits
        return logits, self.norm(hidden.index_select(0, hidden_indices))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(T,) token ids -> (T, hidden). Vocabulary-parallel: each rank looks up the ids in its slice
        and writes zeros for the others; the sum over the ranks is then every token's own row, exactly."""
        parallel = self.parallel
        if parallel is None or not parallel.layout.is_vocab_parallel:
            return self.embed_tokens(input_ids)
        start, end = parallel.layout.vocab
        local = input_ids - start
        is_here = (local >= 0) & (local < end - start)  # (T,)
        hidden = self.embed_tokens(torch.where(is_here, local, 0))
        hidden.masked_fill_(~is_here.unsqueeze(1), 0)
        return parallel.group.all_reduce(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """(N, hidden) normed -> (N, V) float32 logits. Tensor-parallel: rank 0 gets them (the ranks'
        vocabulary slices side by side, the padding rows' columns dropped); a worker gets None on the
        CPU (it samples nothing) and the whole logits on CUDA (an all-gather, see group.py)."""
        parallel = self.parallel
        if parallel is None:
            return self.lm_head(hidden).float()
        if not parallel.layout.is_vocab_parallel:  # replicated: rank 0 alone computes them
            return self.lm_head(hidden).float() if parallel.group.is_first else None
        logits = parallel.group.gather_columns(self.lm_head(hidden))  # (N, world x vocab rows) or None
        if logits is None:
            return None
        if logits.shape[1] != self.vocab_size:
            logits = logits[:, :self.vocab_size].contiguous()
        return logits.float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up; refuses unknown or missing names."""
        cfg = self.cfg
        params = dict(self.named_parameters())
        fused_sizes = {"qkv_proj": [cfg.q_size, cfg.kv_size, cfg.kv_size],
                       "gate_up_proj": [cfg.intermediate_size, cfg.intermediate_size]}
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            parts = name.split(".")
            target = name
            part_index = None
            for i, p in enumerate(parts):
                if p in self._FUSED:
                    fused, part_index = self._FUSED[p]
                    target = ".".join(parts[:i] + [fused] + parts[i + 1:])
                    break
            if target == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            if target.endswith(_FP8_SCALE_SUFFIXES):  # FP8 checkpoints: scales of Fp8Linear layers (and KV)
                from batchgen.engine.quant.fp8_checkpoint import load_fp8_scale

                load_fp8_scale(self, target, tensor, part_index, fused_sizes.get(target.split(".")[-2]))
                continue
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the {cfg.model_type} model")
            param = params[target]
            if part_index is None:
                dest = param
            else:
                sizes = fused_sizes[target.split(".")[-2]]
                offset = sum(sizes[:part_index])
                dest = param[offset:offset + sizes[part_index]]
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
            dest.copy_(tensor.to(dest.dtype))
            loaded.add(f"{target}#{part_index}")
        expected = set()
        for pname in params:
            base = pname.split(".")[-2] if "." in pname else ""
            if base in fused_sizes and pname.endswith("weight") or (base == "qkv_proj" and pname.endswith("bias")):
                n = len(fused_sizes[base])
                expected.update(f"{pname}#{i}" for i in range(n))
            elif not (pname == "lm_head.weight" and cfg.tie_word_embeddings):
                expected.add(f"{pname}#None")
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing tensors: {', '.join(m.split('#')[0] for m in missing[:8])}")
