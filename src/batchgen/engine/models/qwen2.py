"""Qwen2 (Qwen2.5): the Llama decoder with a bias on q/k/v."""

from __future__ import annotations

from batchgen.engine.models.layers.causal_lm import CausalLM


class Qwen2ForCausalLM(CausalLM):
    """HF's Qwen2ForCausalLM: its q/k/v projections always have a bias, which config.json does not state."""

    @classmethod
    def config_fields(cls, hf_config: dict) -> dict:
        return {"attention_bias": bool(hf_config.get("attention_bias", True))}
