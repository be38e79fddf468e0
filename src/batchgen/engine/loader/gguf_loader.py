"""GGUF checkpoints: architecture from metadata, weights dequantized with the `gguf` package.

Mixture of experts (llama.cpp's converter): `{arch}.expert_count` / `expert_used_count` (and for qwen3moe
`expert_feed_forward_length`) in the metadata; the router `blk.L.ffn_gate_inp`; every expert's projection
stacked in one tensor `blk.L.ffn_{gate,up,down}_exps` ((E, out, in) rows-major), or in older files one
tensor per expert `blk.L.ffn_gate.E`. A "llama" file with experts is a Mixtral (llama.cpp reads both so);
llama.cpp renormalises the top-k softmax weights for llama and qwen3moe, not for qwen2moe (Qwen2-MoE),
whose shared expert is `ffn_{gate,up,down}_shexp` with its gate `ffn_gate_inp_shexp`
(`expert_shared_feed_forward_length` wide).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from batchgen.engine.loader.gguf_layout import GGUFArray, GGUFHeader, check_gguf_layout, read_gguf_header
from batchgen.engine.models.config import ModelConfig
from batchgen.engine.models.registry import ARCHITECTURES, gguf_architecture, model_class
from batchgen.engine.parallel.layout import pad_rows
from batchgen.engine.parallel.shards import ShardFn, gguf_shard_array

_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_qkv": "self_attn.qkv_proj",  # stored fused (Phi-3)
    "ffn_gate_inp": "mlp.gate",  # an MoE layer's router
    # qwen2moe's shared expert and its sigmoid gate (llama.cpp may store the gate 1-D: reshaped to (1, H))
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# A family's own meaning of a base name, by HF architecture: Phi-3's ffn_up holds gate and up, fused;
# Gemma's four norms a layer are HF's input_layernorm, post_attention_layernorm (after attention),
# pre_feedforward_layernorm and post_feedforward_layernorm.
_GEMMA_TENSOR_NAMES = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                       "post_ffw_norm": "post_feedforward_layernorm"}
# GLM-4's ffn_up is gate and up fused too (gate rows first, as HF's gate_up_proj), and its norms after
# attention and after the MLP are HF's post_self_attn_layernorm and post_mlp_layernorm.
_FAMILY_TENSOR_NAMES = {"Phi3ForCausalLM": {"ffn_up": "mlp.gate_up_proj"},
                        "Gemma2ForCausalLM": _GEMMA_TENSOR_NAMES, "Gemma3ForCausalLM": _GEMMA_TENSOR_NAMES,
                        "Glm4ForCausalLM": {"ffn_up": "mlp.gate_up_proj",
                                            "post_attention_norm": "post_self_attn_layernorm",
                                            "post_ffw_norm": "post_mlp_layernorm"}}
# Families whose norms scale by (1 + w): llama.cpp's converter stores 1 + w, HF checkpoints (and the model's
# load_weights) w.
_NORM_OFFSET_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# llama.cpp's Gemma hyperparameters (llama-model.cpp) where the file has no key: layer i is local unless
# (i + 1) is a multiple of the pattern; the 27B checkpoint (its layer count) scales queries by
# (hidden / heads) ** -0.5, every other size by head_dim ** -0.5 (HF: query_pre_attn_scalar).
_GEMMA_GGUF = {"gemma2": {"pattern": 2, "num_layers_27b": 46}, "gemma3": {"pattern": 6, "num_layers_27b": 62}}
# An MoE layer's experts: llama.cpp's stacked (E, out, in) tensor, or its per-expert base name in older
# files (blk.L.ffn_gate.E.weight) -> the HF per-expert projection.
_EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_LEGACY_EXPERT_TENSORS = {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
# GGUF architectures whose files may hold experts, and the HF architecture such a file runs as.
_MOE_ARCHITECTURES = {"llama": "MixtralForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM"}
# Whether llama.cpp renormalises the top-k weights (build_moe_ffn's norm_w): qwen2moe does not.
_MOE_RENORMALIZES = {"llama": True, "qwen3moe": True, "qwen2moe": False}


def _reader(path: Path):
    stat = path.stat()
    return _cached_reader(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _cached_reader(path: str, mtime_ns: int, size: int):
    """Parsing the metadata (49k-entry vocab arrays) takes seconds: config and weights share one parse."""
    import gguf

    check_gguf_layout(path)  # GGUFReader trusts declared counts: a crafted one makes it loop for hours
    try:
        return gguf.GGUFReader(path)
    except Exception as exc:  # corrupt or truncated file
        raise ValueError(f"cannot read GGUF file {path}: {exc}") from exc


def read_gguf_config(path: Path) -> ModelConfig:
    """The model's config from the header's metadata alone (gguf_layout.py's checked walk: no array
    is parsed, no tensor mapped); ValueError naming the file and the key for what it lacks."""
    header = read_gguf_header(path)
    arch = header.metadata.get("general.architecture")
    architecture = gguf_architecture(arch, f"GGUF file {path}")  # the HF name it runs as

    def field(key: str, default=None, required: bool = False):
        value = header.metadata.get(key, default)
        if isinstance(value, GGUFArray) or (value is None and required):
            raise ValueError(f"GGUF file {path}: metadata {key!r} is "
                             + ("missing" if value is None else "an array, not a number"))
        return value

    num_heads = field(f"{arch}.attention.head_count", required=True)
    hidden = field(f"{arch}.embedding_length", required=True)
    names = set(header.tensor_names)
    vocab = field(f"{arch}.vocab_size") or _num_tokens(header)
    head_dim = (field(f"{arch}.attention.key_length") or field(f"{arch}.rope.dimension_count")
                or hidden // num_heads)
    eos = field("tokenizer.ggml.eos_token_id")
    scaling = None
    if field(f"{arch}.rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": field(f"{arch}.rope.scaling.factor")}
    family = {}
    num_experts = field(f"{arch}.expert_count", 0)
    if num_experts:
        architecture = _MOE_ARCHITECTURES.get(arch)
        if architecture is None:
            raise ValueError(f"GGUF file {path}: architecture {arch!r} with experts is not supported "
                             f"({', '.join(_MOE_ARCHITECTURES)})")
        family = _moe_fields(path, arch, field, num_experts)
    if arch == "phi3":  # its rope.dimension_count is the rotary width, not head_dim
        head_dim = field(f"{arch}.attention.key_length") or hidden // num_heads
        family = _phi3_fields(path, field, head_dim, names)
    elif arch in _GEMMA_GGUF:
        family = _gemma_fields(path, arch, field, head_dim)
    elif arch == "glm4":  # its rope.dimension_count is the rotary width (half a head), not head_dim
        head_dim = field(f"{arch}.attention.key_length") or hidden // num_heads
        family = {"sandwich_norms": True, "rope_interleaved": True,
                  "partial_rotary_factor": (field(f"{arch}.rope.dimension_count") or head_dim // 2) / head_dim}
    fields = dict(
        model_type=ARCHITECTURES[architecture].model_type,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=field(f"{arch}.feed_forward_length", required=True),
        num_layers=field(f"{arch}.block_count", required=True),
        num_heads=num_heads,
        num_kv_heads=field(f"{arch}.attention.head_count_kv") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=float(field(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=field(f"{arch}.context_length", 4096),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        rope_scaling=scaling,
        bos_token_id=field("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (eos,),
        architecture=architecture,
    )
    return ModelConfig(**{**fields, **family})


def _phi3_fields(path: Path, field, head_dim: int, names: set[str]) -> dict:
    """What llama.cpp's converter writes for Phi-3 besides the shared keys: the rotary width
    (partial rotary), the sliding window (0: none) and LongRoPE (its factors as two small float32
    tensors, the original context and the cos/sin factor as metadata)."""
    rotary_dim = field("phi3.rope.dimension_count") or head_dim
    window = field("phi3.attention.sliding_window")
    fields = {"partial_rotary_factor": rotary_dim / head_dim, "sliding_window": window or None}
    if "rope_factors_long.weight" in names:
        tensors = {t.name: t for t in _reader(path).tensors}
        original = field("phi3.rope.scaling.original_context_length", required=True)
        fields["rope_scaling"] = {
            "rope_type": "longrope", "original_max_position_embeddings": original,
            "long_factor": [float(x) for x in tensors["rope_factors_long.weight"].data],
            "short_factor": [float(x) for x in tensors["rope_factors_short.weight"].data],
            "factor": field("phi3.context_length", required=True) / original,
            "attention_factor": field("phi3.rope.scaling.attn_factor")}
    return fields


def _gemma_fields(path: Path, arch: str, field, head_dim: int) -> dict:
    """What llama.cpp reads for Gemma 2 / Gemma 3 besides the shared keys (llama-model.cpp's hparams):
    the window (Gemma 2: 4,096 when absent), the local/global pattern (a period or one bool a layer),
    Gemma 2's soft-caps (50 and 30 when absent), Gemma 3's local rope base (10,000 when absent), and the
    query scale by llama.cpp's rule (GGUF files carry no query_pre_attn_scalar)."""
    rules = _GEMMA_GGUF[arch]
    num_layers = field(f"{arch}.block_count", required=True)
    window = field(f"{arch}.attention.sliding_window", 4096 if arch == "gemma2" else None)
    pattern_key = f"{arch}.attention.sliding_window_pattern"
    pattern = read_gguf_header(path).metadata.get(pattern_key, rules["pattern"])
    if isinstance(pattern, GGUFArray):  # one bool a layer: true = sliding
        is_sliding = [bool(x) for x in _reader(path).fields[pattern_key].contents()]
        if len(is_sliding) != num_layers:
            raise ValueError(f"GGUF file {path}: metadata {pattern_key!r} has {len(is_sliding)} entries for "
                             f"{num_layers} layers")
    else:
        is_sliding = [pattern == 0 or i % pattern < pattern - 1 for i in range(num_layers)]
    hidden, num_heads = field(f"{arch}.embedding_length"), field(f"{arch}.attention.head_count")
    fields = {"sandwich_norms": True, "hidden_act": "gelu_pytorch_tanh", "sliding_window": window or None,
              "layer_types": tuple("sliding_attention" if s else "full_attention" for s in is_sliding),
              "query_pre_attn_scalar": hidden // num_heads if num_layers == rules["num_layers_27b"] else head_dim}
    if arch == "gemma2":
        fields["attn_logit_softcapping"] = float(field(f"{arch}.attn_logit_softcapping", 50.0))
        fields["final_logit_softcapping"] = float(field(f"{arch}.final_logit_softcapping", 30.0))
    else:
        fields["rope_local_theta"] = float(field(f"{arch}.rope.freq_base_swa", 10000.0))
    return fields


def _moe_fields(path: Path, arch: str, field, num_experts: int) -> dict:
    """The MoE ModelConfig fields of a llama / qwen3moe / qwen2moe file: a softmax router over every expert,
    the top expert_used_count, renormalised as llama.cpp's build_moe_ffn does for the architecture, every
    layer sparse; qwen2moe's shared expert. ValueError naming the key for a gating or weight scale
    llama.cpp applies that these families lack."""
    top_k = field(f"{arch}.expert_used_count", required=True)
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"GGUF file {path}: {arch}.expert_used_count {top_k} is not in [1, {num_experts}]")
    gating = field(f"{arch}.expert_gating_func", 1)  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE: 1 softmax
    if gating != 1:
        raise ValueError(f"GGUF file {path}: {arch}.expert_gating_func {gating} is not supported (1: softmax)")
    scale = field(f"{arch}.expert_weights_scale", 1.0)
    if scale not in (0.0, 1.0):  # llama.cpp applies it only when != 0
        raise ValueError(f"GGUF file {path}: {arch}.expert_weights_scale {scale} is not supported (1.0)")
    width = field(f"{arch}.expert_feed_forward_length") or field(f"{arch}.feed_forward_length", required=True)
    fields = {"num_experts": num_experts, "num_experts_per_tok": top_k, "moe_intermediate_size": width,
              "moe_router": "softmax_topk", "moe_renormalize": _MOE_RENORMALIZES[arch]}
    if arch == "qwen2moe":
        fields["shared_expert_intermediate_size"] = field(f"{arch}.expert_shared_feed_forward_length", required=True)
    return fields


def _num_tokens(header: GGUFHeader) -> int:
    tokens = header.metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, GGUFArray) or not tokens.is_strings:
        raise ValueError(f"GGUF file {header.path}: no vocabulary (neither a vocab_size key nor a "
                         "tokenizer.ggml.tokens array of strings)")
    return tokens.num_items


def _reverse_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rope -> HF's rotate-half layout)."""
    dim = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def hf_tensor_name(gguf_name: str, cfg: ModelConfig | None = None) -> str | None:
    """The HF name of a GGUF tensor (of the model `cfg`: a family may read a base name its own way), or
    None for tensors the model recomputes (rope_freqs, Phi-3's rope factors)."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and parts[2] in _EXPERT_TENSORS:  # stacked: iter_gguf_weights yields it per expert
        return f"model.layers.{parts[1]}.mlp.experts.{_EXPERT_TENSORS[parts[2]]}"
    if parts[0] == "blk" and len(parts) == 5 and parts[2] in _LEGACY_EXPERT_TENSORS:  # blk.L.ffn_gate.E.weight
        return f"model.layers.{parts[1]}.mlp.experts.{parts[3]}.{_LEGACY_EXPERT_TENSORS[parts[2]]}.{parts[4]}"
    if parts[0] == "blk":
        layer, base, kind = parts[1], parts[2], parts[3]
        names = _FAMILY_TENSOR_NAMES.get(cfg.architecture, {}) if cfg is not None else {}
        return f"model.layers.{layer}.{names[base] if base in names else _TENSOR_NAMES[base]}.{kind}"
    base, kind = parts[0], parts[1]
    if base not in _TENSOR_NAMES:
        return None  # e.g. rope_freqs: recomputed from the config
    return f"{_TENSOR_NAMES[base]}.{kind}"


def _is_rope_permuted(cfg: ModelConfig, base: str) -> bool:
    return model_class(cfg).is_gguf_qk_permuted and base in ("attn_q", "attn_k")


def row_permutation(cfg: ModelConfig, base: str, num_rows: int) -> np.ndarray | None:
    """The row order _reverse_permute gives a q/k weight of num_rows rows (None for other tensors)."""
    if not _is_rope_permuted(cfg, base):
        return None
    heads = cfg.num_heads if base == "attn_q" else cfg.num_kv_heads
    return _reverse_permute(np.arange(num_rows), heads)


def iter_gguf_weights(path: Path, cfg: ModelConfig, skip: frozenset[str] = frozenset(),
                      shard: ShardFn | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every tensor in the file but the HF names in `skip`.

    `shard` (tensor parallelism): only this rank's slice of each tensor is dequantized, and `cfg` is
    the rank's (its head counts undo llama.cpp's q/k row order, which stays within each head)."""
    reader = _reader(path)
    for tensor in reader.tensors:
        parts = tensor.name.split(".")
        name = hf_tensor_name(tensor.name, cfg)
        if name is None or name in skip:
            continue
        base = parts[2] if parts[0] == "blk" else parts[0]
        if parts[0] == "blk" and base in _EXPERT_TENSORS:
            yield from _iter_experts(tensor, name, shard)
            continue
        spec = None if shard is None else shard(name, tuple(int(d) for d in reversed(tensor.shape)))
        array = gguf_shard_array(tensor, spec)
        if spec is not None and spec.dim == 0 and spec.size != array.shape[0]:  # the vocabulary's padded tail
            array = pad_rows(torch.from_numpy(array), spec.size).numpy()
        if base == "ffn_gate_inp_shexp" and array.ndim == 1:
            array = array[None, :]
        if parts[0] == "blk" and _is_rope_permuted(cfg, base):
            array = _reverse_permute(array, cfg.num_heads if base == "attn_q" else cfg.num_kv_heads)
        if cfg.architecture in _NORM_OFFSET_ARCHITECTURES and name.endswith("norm.weight"):
            array = array.astype(np.float32) - np.float32(1.0)  # back to HF's w (exact for 1 + w >= 0.5)
        if not array.flags.writeable or not array.flags.c_contiguous:  # F32 tensors are views of the mmap
            array = np.array(array, order="C")
        yield name, torch.from_numpy(array)


def _iter_experts(tensor, stacked_name: str, shard: ShardFn | None) -> Iterator[tuple[str, torch.Tensor]]:
    """A stacked expert tensor (E, out, in) as its E per-expert HF tensors (`...experts.N.<proj>.weight`),
    each dequantized on its own (a real file's stack is hundreds of MB in float32); `shard`: the
    rank's rows or columns of each."""
    from gguf.quants import dequantize

    num_experts, num_rows, num_columns = (int(d) for d in reversed(tensor.shape))
    layer_prefix, projection = stacked_name.rsplit(".", 1)
    for expert in range(num_experts):
        name = f"{layer_prefix}.{expert}.{projection}.weight"
        array = np.asarray(dequantize(tensor.data[expert], tensor.tensor_type), dtype=np.float32)
        array = array.reshape(num_rows, num_columns)
        spec = None if shard is None else shard(name, (num_rows, num_columns))
        if spec is not None:
            array = array[spec.start:spec.end] if spec.dim == 0 else array[:, spec.start:spec.end]
        yield name, torch.from_numpy(np.array(array, order="C"))
