"""Qwen2-MoE (Qwen2MoeForCausalLM: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (a bias on q/k/v)
with sparse MoE blocks: a softmax router, the top k experts (renormalised when `norm_topk_prob`), experts
moe_intermediate_size wide, and a shared expert every token runs (shared_expert_intermediate_size wide)
scaled by sigmoid(shared_expert_gate(x)). Layers in `mlp_only_layers`, or whose index + 1 is not a multiple
of `decoder_sparse_step`, keep a dense MLP intermediate_size wide."""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchgen.engine.models.layers.moe_causal_lm import MoECausalLM, moe_config_fields, refuse_sliding_window
from batchgen.engine.models.qwen3_moe import sparse_step_dense_layers

if TYPE_CHECKING:
    from batchgen.engine.attention.base import AttentionBackend
    from batchgen.engine.models.config import ModelConfig
    from batchgen.engine.parallel import TensorParallel


class Qwen2MoeForCausalLM(MoECausalLM):
    """HF's Qwen2MoeForCausalLM."""

    def __init__(self, cfg: ModelConfig, max_positions: int, attention_backend: AttentionBackend,
                 parallel: TensorParallel | None = None):
        refuse_sliding_window("Qwen2MoeForCausalLM", cfg.sliding_window, max_positions)
        super().__init__(cfg, max_positions, attention_backend, parallel)

    @classmethod
    def config_fields(cls, hf_config: dict) -> dict:
        shared = hf_config.get("shared_expert_intermediate_size", 0)
        if not isinstance(shared, int) or shared < 0:
            raise ValueError(f"Qwen2MoeForCausalLM: config.json's shared_expert_intermediate_size must be an integer "
                             f">= 0, got {shared!r}")
        return {**moe_config_fields(hf_config, num_experts_key="num_experts", moe_intermediate_key="moe_intermediate_size",
                                    renormalize=bool(hf_config.get("norm_topk_prob", False)),
                                    dense_layers=sparse_step_dense_layers(hf_config)),
                "attention_bias": bool(hf_config.get("qkv_bias", True)),  # q/k/v always biased in released configs
                "shared_expert_intermediate_size": shared,
                # HF applies the window only with use_sliding_window (off in every published config)
                "sliding_window": hf_config.get("sliding_window") if hf_config.get("use_sliding_window") else None}
