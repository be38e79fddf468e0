"""Mixtral (MixtralForCausalLM): the Llama/Mistral decoder with a sparse MoE block in every layer: a
softmax router, the top k (2) experts, their weights renormalised to sum to one; experts w1 (gate),
w3 (up), w2 (down)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchgen.engine.models.layers.moe_causal_lm import MoECausalLM, moe_config_fields, refuse_sliding_window

if TYPE_CHECKING:
    from batchgen.engine.attention.base import AttentionBackend
    from batchgen.engine.models.config import ModelConfig
    from batchgen.engine.parallel import TensorParallel


class MixtralForCausalLM(MoECausalLM):
    """HF's MixtralForCausalLM: every layer sparse, experts intermediate_size wide."""

    is_gguf_qk_permuted = True  # llama.cpp writes it as a "llama" (q/k rows in its interleaved rope order)

    def __init__(self, cfg: ModelConfig, max_positions: int, attention_backend: AttentionBackend,
                 parallel: TensorParallel | None = None):
        refuse_sliding_window("MixtralForCausalLM", cfg.sliding_window, max_positions)
        super().__init__(cfg, max_positions, attention_backend, parallel)

    @classmethod
    def config_fields(cls, hf_config: dict) -> dict:
        return {**moe_config_fields(hf_config, num_experts_key="num_local_experts",
                                    moe_intermediate_key="intermediate_size", renormalize=True),
                "sliding_window": hf_config.get("sliding_window")}
