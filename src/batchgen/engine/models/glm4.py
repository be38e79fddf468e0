"""GLM-4 (the GLM-4-0414 family, HF's Glm4ForCausalLM): the Llama decoder with the attention and MLP
outputs normed too (sandwich norms), q/k/v biases, and rope on adjacent pairs of each head's first
half (partial, interleaved rotary). The checkpoint stores gate and up fused, as the engine holds them.
"""

from __future__ import annotations

from typing import ClassVar

from batchgen.engine.models.layers.causal_lm import CausalLM
from batchgen.engine.models.layers.sandwich_norm_decoder import SandwichNormDecoderLayer

# transformers' Glm4Config sets this when config.json does not.
_DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5


class Glm4ForCausalLM(CausalLM):
    """HF's Glm4ForCausalLM: post_self_attn_layernorm and post_mlp_layernorm beside the pre-norms,
    `attention_bias` (default true), rope on pairs (2i, 2i + 1) of the first partial_rotary_factor
    (default 0.5) of each head, and `mlp.gate_up_proj` fused in the checkpoint (gate rows first)."""

    layer_class = SandwichNormDecoderLayer
    # q/k/v apart as Llama's; gate_up_proj loads as it is, a plain tensor of the checkpoint.
    _FUSED: ClassVar[dict[str, tuple[str, int]]] = {
        name: target for name, target in CausalLM._FUSED.items() if target[0] == "qkv_proj"}

    @classmethod
    def config_fields(cls, hf_config: dict) -> dict:
        rope_parameters = hf_config.get("rope_parameters") or {}
        is_factor_stated = "partial_rotary_factor" in hf_config or "partial_rotary_factor" in rope_parameters
        fields = {"sandwich_norms": True, "rope_interleaved": True,
                  "attention_bias": bool(hf_config.get("attention_bias", True))}
        if not is_factor_stated:
            fields["partial_rotary_factor"] = _DEFAULT_PARTIAL_ROTARY_FACTOR
        return fields

    def fused_part_sizes(self) -> dict[str, list[int]]:
        sizes = super().fused_part_sizes()
        del sizes["gate_up_proj"]
        return sizes
