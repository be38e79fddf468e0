"""Phi-3 and Phi-4 (Phi3ForCausalLM): the Llama decoder with its checkpoint already fused (qkv_proj,
gate_up_proj), LongRoPE where configured and partial rotary (Phi-4-mini: 0.75).

LongRoPE (rope_scaling type `longrope`; older configs say `su`, or `yarn`, which HF's Phi3Config reads as
longrope) divides the inverse frequencies by `short_factor` or `long_factor` and multiplies cos and
sin by sqrt(1 + ln(s) / ln(original_max_position_embeddings)), s = max_position_embeddings /
original_max_position_embeddings. HF's class picks the factors per forward by the sequence's current
length; the engine picks them once for the whole model by max_model_len, as vLLM does (long when
max_model_len > original_max_position_embeddings): layers/rotary.py's RotaryEmbedding says where the
two agree. A model run at its full 128k context therefore uses the long factors for short prompts
too; max_model_len <= original_max_position_embeddings gives the short ones.

A config's `sliding_window` masks every layer as HF's mask does (each query sees the last W positions,
itself included), in every attention backend; Phi-3-mini-128k's 262144 never masks anything.
"""

from __future__ import annotations

from typing import ClassVar

from batchgen.engine.models.layers.causal_lm import CausalLM
from batchgen.engine.models.layers.rotary import rope_type

# HF's Phi3Config reads these rope_scaling types as longrope (its convert_rope_params_to_dict).
_LONGROPE_NAMES = ("longrope", "su", "yarn")
# Phi3Config's default when config.json leaves original_max_position_embeddings out.
_ORIGINAL_MAX_POSITIONS = 4096


class Phi3ForCausalLM(CausalLM):
    """HF's Phi3ForCausalLM. Its checkpoints hold qkv_proj and gate_up_proj as the engine's modules
    do (q, k, v rows; gate rows, then up rows), so nothing maps to a fused part: each tensor loads whole."""

    _FUSED: ClassVar[dict[str, tuple[str, int]]] = {}

    def fused_part_sizes(self) -> dict[str, list[int]]:
        return {}  # no checkpoint tensor is a part of a fused module

    @classmethod
    def config_fields(cls, hf_config: dict) -> dict:
        act = hf_config.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"Phi3ForCausalLM: hidden_act {act!r} is not supported (silu)")
        params = hf_config.get("rope_parameters")
        params = params if isinstance(params, dict) else {}
        # HF: rope_scaling (older configs) wins over rope_parameters, and the partial_rotary_factor inside
        # them over the top-level one.
        scaling = hf_config.get("rope_scaling") or params
        partial = scaling.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0))
        return {"partial_rotary_factor": float(partial), "sliding_window": hf_config.get("sliding_window"),
                "rope_scaling": _longrope_scaling(hf_config, scaling)}


def _longrope_scaling(hf_config: dict, scaling: dict) -> dict | None:
    """The rope_scaling the engine runs (None: plain rope): LongRoPE's factors with its original
    context and `factor` filled in."""
    kind = rope_type(scaling)
    if kind == "default":
        return None
    if kind not in _LONGROPE_NAMES:
        raise ValueError(f"Phi3ForCausalLM: rope_scaling type {kind!r} is not supported (longrope)")
    # HF's Phi3Config always has the top-level attribute (4096 when config.json leaves it out), and it
    # overrides rope_scaling's own.
    original = hf_config.get("original_max_position_embeddings", _ORIGINAL_MAX_POSITIONS)
    factor = scaling.get("factor") or hf_config.get("max_position_embeddings", 4096) / original
    return {"rope_type": "longrope", "short_factor": list(scaling["short_factor"]),
            "long_factor": list(scaling["long_factor"]), "original_max_position_embeddings": original,
            "factor": factor, "attention_factor": scaling.get("attention_factor")}
