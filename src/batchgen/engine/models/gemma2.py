"""Gemma 2 (HF's Gemma2ForCausalLM): the sandwich-norm block with Gemma's (1 + w) RMSNorms, GeGLU,
embeddings scaled by sqrt(hidden_size), softmax scale query_pre_attn_scalar ** -0.5, sliding-window
layers alternating with global ones (layer_types), attention logits soft-capped (50) and the final
logits soft-capped (30).

The four norms of a layer map onto SandwichNormDecoderLayer's: Gemma's `post_attention_layernorm`
norms the attention output (our `post_self_attn_layernorm`), `pre_feedforward_layernorm` the MLP's
input (our `post_attention_layernorm`, Llama's name for it), `post_feedforward_layernorm` the MLP
output (our `post_mlp_layernorm`). Gemma's norms scale by (1 + w): the loader adds the 1 to every
norm weight in float32 as it reads the checkpoint, so the shared RMSNorm runs them unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from batchgen.engine.models.layers.causal_lm import CausalLM
from batchgen.engine.models.layers.sandwich_norm_decoder import SandwichNormDecoderLayer

# Gemma's checkpoint norm names -> the block's (SandwichNormDecoderLayer).
_NORM_NAMES = {"post_attention_layernorm": "post_self_attn_layernorm",
               "pre_feedforward_layernorm": "post_attention_layernorm",
               "post_feedforward_layernorm": "post_mlp_layernorm"}


class Gemma2ForCausalLM(CausalLM):
    """HF's Gemma2ForCausalLM; Gemma 3's text model (gemma3.py) builds on it."""

    layer_class = SandwichNormDecoderLayer
    # transformers' Gemma2Config defaults, for config.json files that leave a key out.
    _DEFAULTS = {"sliding_window": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                 "query_pre_attn_scalar": 256}
    _SLIDING_WINDOW_PATTERN = 2  # without layer_types: every other layer is local, the first one included

    @classmethod
    def config_fields(cls, hf_config: dict) -> dict:
        act = hf_config.get("hidden_activation") or hf_config.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new"):
            raise ValueError(f"{cls.__name__}: hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
        values = {key: hf_config.get(key, default) for key, default in cls._DEFAULTS.items()}
        return {"sandwich_norms": True, "hidden_act": "gelu_pytorch_tanh",
                "tie_word_embeddings": bool(hf_config.get("tie_word_embeddings", True)),
                "sliding_window": values["sliding_window"], "layer_types": cls.layer_types(hf_config),
                "attn_logit_softcapping": values["attn_logit_softcapping"],
                "final_logit_softcapping": values["final_logit_softcapping"],
                "query_pre_attn_scalar": values["query_pre_attn_scalar"]}

    @classmethod
    def layer_types(cls, hf_config: dict) -> tuple[str, ...]:
        """config.json's layer_types, or transformers' pattern when it has none: layer i is local
        unless (i + 1) is a multiple of the pattern (`sliding_window_pattern` in older Gemma 3 configs)."""
        types = hf_config.get("layer_types")
        if types:
            unknown = set(types) - {"sliding_attention", "full_attention"}
            if unknown:
                raise ValueError(f"{cls.__name__}: layer_types {sorted(unknown)} are not supported "
                                 f"(sliding_attention, full_attention)")
            return tuple(types)
        pattern = hf_config.get("sliding_window_pattern") or cls._SLIDING_WINDOW_PATTERN
        return tuple("sliding_attention" if (i + 1) % pattern else "full_attention"
                     for i in range(hf_config["num_hidden_layers"]))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Gemma scales the embeddings by sqrt(hidden_size), the factor rounded to the model's dtype
        first as HF does (in bfloat16, sqrt(3584) = 59.87 becomes 60.0)."""
        hidden = super().embed(input_ids)  # (T, hidden)
        return hidden * torch.tensor(self.cfg.hidden_size ** 0.5, dtype=hidden.dtype, device=hidden.device)

    def checkpoint_target(self, name: str) -> tuple[str, int | None]:
        parts = name.split(".")
        return super().checkpoint_target(".".join(_NORM_NAMES.get(part, part) for part in parts))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF-named tensors in, the norm weights as HF stores them (Gemma's w: the scale is 1 + w; the
        GGUF loader turns llama.cpp's stored 1 + w back into w)."""
        super().load_weights(_norms_plus_one(weights))


def _norms_plus_one(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every RMSNorm weight w as 1 + w (in float32, as HF's Gemma RMSNorm computes it)."""
    for name, tensor in weights:
        yield name, tensor.float() + 1.0 if name.endswith("norm.weight") else tensor
