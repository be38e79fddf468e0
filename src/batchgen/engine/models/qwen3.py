"""Qwen3: the Llama decoder with an RMSNorm on every q and k head before rope (and Qwen2's sliding
window where the config turns it on)."""

from __future__ import annotations

from batchgen.engine.models.layers.causal_lm import CausalLM
from batchgen.engine.models.qwen2 import qwen_sliding_windows


class Qwen3ForCausalLM(CausalLM):
    """HF's Qwen3ForCausalLM: q_norm / k_norm per head (always there; config.json does not state them)."""

    @classmethod
    def config_fields(cls, hf_config: dict) -> dict:
        return {"qk_norm": True, **qwen_sliding_windows(hf_config, cls.__name__)}
