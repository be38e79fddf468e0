"""Qwen3: the Llama decoder with an RMSNorm on every q and k head before rope."""

from __future__ import annotations

from batchgen.engine.models.layers.causal_lm import CausalLM


class Qwen3ForCausalLM(CausalLM):
    """HF's Qwen3ForCausalLM: q_norm / k_norm per head (always there; config.json does not state them)."""

    @classmethod
    def config_fields(cls, hf_config: dict) -> dict:
        return {"qk_norm": True}
