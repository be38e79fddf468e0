"""The pre-norm decoder block and the decoder stack (embedding, blocks, final norm) over flat token batches.

A step's tokens from all sequences are one flat (T,) batch: no padding in the dense layers. q/k/v and
gate/up are fused into one matmul each; HF checkpoints keep them apart (`_FUSED` maps the names).

Tensor parallelism (engine/parallel/): a rank's model is built from its own ModelConfig (its query
and KV heads, MLP channels and vocabulary rows: the layers are plain linear layers of those shapes,
whatever the loader swaps them for), and the stack adds the collectives: the embedding's sum over
the ranks' vocabulary slices, one all-reduce after o_proj and one after down_proj (the row-parallel
layers' partial sums). The heads (causal_lm.py) add theirs.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from batchgen.engine.attention.base import LayerAttention
from batchgen.engine.models.layers.attention import Attention
from batchgen.engine.models.layers.mlp import GatedMLP
from batchgen.engine.models.layers.norm import RMSNorm
from batchgen.engine.models.layers.rotary import RotaryEmbedding
from batchgen.engine.models.ops import compiled_ops, cpu_kernel_ops, eager_ops

if TYPE_CHECKING:
    from types import SimpleNamespace

    from batchgen.engine.attention.base import AttentionBackend, AttentionMetadata
    from batchgen.engine.models.config import ModelConfig
    from batchgen.engine.parallel import TensorParallel
    from batchgen.engine.parallel.group import TensorParallelGroup


class DecoderLayer(nn.Module):
    """Llama's block: h = x + attn(norm(x)); out = h + mlp(norm(h)). The residual add is fused into
    the next norm (ops.add_rms_norm): a block returns its MLP output and the residual stream apart."""

    def __init__(self, cfg: ModelConfig, layer_index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                rope: tuple[torch.Tensor, torch.Tensor], backend: AttentionBackend, kv_cache: tuple,
                meta: AttentionMetadata, ops: SimpleNamespace,
                group: TensorParallelGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, hidden) output of the previous block and the residual stream (None before the first
        block) -> this block's (output, residual stream); `group`: tensor parallelism's, or None."""
        norm = self.input_layernorm
        if residual is None:
            residual = hidden
            x = ops.rms_norm(hidden, norm.weight, norm.eps)
        else:
            x, residual = ops.add_rms_norm(hidden, residual, norm.weight, norm.eps)
        x = self.self_attn(x, rope, backend, kv_cache, meta, ops)
        if group is not None:
            group.all_reduce(x)  # o_proj's partial sums over the ranks' heads
        x = self.attention_output(x, ops)
        norm = self.post_attention_layernorm
        x, residual = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        hidden = self.mlp(x, ops)
        if group is not None:
            group.all_reduce(hidden)  # down_proj's partial sums over the ranks' MLP channels
        return self.mlp_output(hidden, ops), residual

    def attention_output(self, x: torch.Tensor, ops: SimpleNamespace) -> torch.Tensor:
        """The attention's (T, hidden) output as it joins the residual stream (whole sums, after tensor
        parallelism's all-reduce): as it is here; a block that norms it overrides this (GLM-4)."""
        return x

    def mlp_output(self, hidden: torch.Tensor, ops: SimpleNamespace) -> torch.Tensor:
        """The MLP's (T, hidden) output as it joins the residual stream: as it is here (see
        attention_output)."""
        return hidden


class DecoderModel(nn.Module):
    """The decoder stack without a head: embed_tokens, `layers`, the final `norm`, the rotary tables.

    Parameters are named as HF's checkpoints name them less the `model.` prefix (q/k/v and gate/up
    fused); a head (causal_lm.py) adds its own beside them. A family changes the block through
    `layer_class` and what it reads from config.json through `config_fields`.
    """

    # The block every layer is.
    layer_class: ClassVar[type[nn.Module]] = DecoderLayer
    # HF checkpoint name -> (our parameter, slice index into the fused tensor). A checkpoint that is
    # already fused (Phi-3's qkv_proj, gate_up_proj) maps nothing: its tensors load whole.
    _FUSED: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    # Whether llama.cpp's converter permutes this family's q/k rows (interleaved rope) in GGUF files.
    is_gguf_qk_permuted: ClassVar[bool] = False

    def __init__(self, cfg: ModelConfig, max_positions: int, attention_backend: AttentionBackend,
                 parallel: TensorParallel | None = None):
        """`cfg`: the shapes of this model's modules; with `parallel`, the rank's (layout.rank_config)."""
        super().__init__()
        self.cfg = cfg
        self.parallel = parallel
        # No random init (the loader fills every weight): nn.Embedding's normal_ on the meta device
        # imports torch._dynamo, seconds of every process's load (each tensor-parallel rank's too).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(self.layer_class(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = self.make_rotary(max_positions)
        self.backend = attention_backend
        if attention_backend is not None:  # None: a model built only to hold weights (build_empty_model)
            attention_backend.configure_layers(self.attention_layers(max_positions), cfg.attention_scale)
        if parallel is not None and cfg.qk_norm_over_heads:  # OLMo 2: q/k norms over heads split across ranks
            layout = parallel.layout
            for layer in self.layers:
                layer.self_attn.set_qk_norm_group(parallel.group, layout.total_query_heads * cfg.head_dim,
                                                  layout.total_kv_heads * cfg.head_dim)
        self.ops = eager_ops()

    @classmethod
    def config_fields(cls, hf_config: dict) -> dict:
        """ModelConfig fields this family reads from config.json its own way (over the generic reading
        in ModelConfig.from_hf_dict), e.g. a bias HF's class always has."""
        return {}

    def attention_layers(self, max_positions: int) -> list[LayerAttention]:
        """Each layer's window and soft-cap, for the attention backend. A window of at least
        max_positions never masks a key, so it is dropped (the kernels then skip the window test)."""
        cfg = self.cfg
        layers = []
        for i in range(cfg.num_layers):
            window = cfg.layer_sliding_window(i)
            layers.append(LayerAttention(window if window is not None and window < max_positions else None,
                                         cfg.attn_logit_softcapping))
        return layers

    def make_rotary(self, max_positions: int) -> RotaryEmbedding:
        """The rotary tables for positions below max_positions (the loader rebuilds them on the real
        device after the weights are in: on the meta device they are shapes only)."""
        cfg = self.cfg
        return RotaryEmbedding(cfg.rotary_dim, max_positions, cfg.rope_theta, cfg.rope_scaling,
                               cfg.rope_interleaved, cfg.head_dim)

    def enable_compile(self) -> None:
        """Fuse the elementwise passes with torch.compile (compiles on first use, once per op)."""
        self.ops = compiled_ops()

    def enable_cpu_kernels(self) -> None:
        """Fused C elementwise kernels (CPU, float32): rotary and the residual add then work in place."""
        self.ops = cpu_kernel_ops()

    def tie_weights(self) -> None:
        """Re-tie shared tensors after to_empty()/to() (which make fresh ones); a stack shares none."""

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple],
                      meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: (T,) -> (T, hidden) after the last block, before the final norm (a head
        norms only the rows it reads)."""
        ops = self.ops
        backend = self.backend
        group = self.parallel.group if self.parallel is not None else None
        hidden = self.embed(input_ids)  # (T, hidden)
        rope = self.rotary.lookup(positions, hidden.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(hidden, residual, rope, backend, kv_cache, meta, ops, group)
        return hidden + residual

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

    # ---- HF checkpoints ----------------------------------------------------------------------------

    def checkpoint_target(self, name: str) -> tuple[str, int | None]:
        """(our parameter name, part index in its fused tensor or None) of an HF checkpoint tensor."""
        parts = name.removeprefix("model.").split(".")
        for i, part in enumerate(parts):
            if part in self._FUSED:
                fused, part_index = self._FUSED[part]
                return ".".join(parts[:i] + [fused] + parts[i + 1:]), part_index
        return ".".join(parts), None

    def fused_part_sizes(self) -> dict[str, list[int]]:
        """Fused module name -> its parts' output rows, in `_FUSED`'s part order."""
        cfg = self.cfg
        return {"qkv_proj": [cfg.q_size, cfg.kv_size, cfg.kv_size],
                "gate_up_proj": [cfg.intermediate_size, cfg.intermediate_size]}

    def is_tied_checkpoint_name(self, target: str) -> bool:
        """Whether a checkpoint tensor (our name) is a copy of another that the model shares (skipped)."""
        return False

    def is_placed_apart(self, param_name: str) -> bool:
        """A parameter a subclass's load_weights fills itself before this one runs (MoE experts:
        layers/moe_causal_lm.py); not expected here."""
        return False

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up; refuses unknown or missing names.
        FP8 checkpoints' scales are placed by the loader (quant/fp8_checkpoint.placing_fp8_scales)."""
        cfg = self.cfg
        if self.parallel is not None:  # qkv_proj / gate_up_proj stored fused arrive whole (layout.shard)
            weights = _rank_rows(weights, self.parallel.layout)
        params = dict(self.named_parameters())
        fused_sizes = self.fused_part_sizes()
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            target, part_index = self.checkpoint_target(hf_name)
            if self.is_tied_checkpoint_name(target):
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
            if self.is_placed_apart(pname):
                continue
            if base in fused_sizes and (pname.endswith("weight") or (base == "qkv_proj" and pname.endswith("bias"))):
                n = len(fused_sizes[base])
                expected.update(f"{pname}#{i}" for i in range(n))
            elif not self.is_tied_checkpoint_name(pname) and not self.is_placed_apart(pname):
                expected.add(f"{pname}#None")
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing tensors: {', '.join(m.split('#')[0] for m in missing[:8])}")


def _rank_rows(weights: Iterable[tuple[str, torch.Tensor]], layout) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each weight stored fused (Phi-3's qkv_proj and gate_up_proj, GLM-4's
    gate_up_proj) cut to this rank's rows: its q, k, v or gate, up rows are no one range."""
    for name, tensor in weights:
        parts = name.split(".")
        rows = layout.fused_rows(parts[-2]) if len(parts) > 1 and parts[-1] == "weight" else None
        yield name, tensor if rows is None else torch.cat([tensor[start:end] for start, end in rows])
