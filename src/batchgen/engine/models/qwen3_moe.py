"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention (q/k norms per head) with sparse MoE blocks:
a softmax router, the top k (8 of 128) experts, renormalised when `norm_topk_prob`; experts
moe_intermediate_size wide. Layers in `mlp_only_layers`, or whose index + 1 is not a multiple of
`decoder_sparse_step`, keep a dense MLP intermediate_size wide."""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchgen.engine.models.layers.moe_causal_lm import MoECausalLM, moe_config_fields, refuse_sliding_window

if TYPE_CHECKING:
    from batchgen.engine.attention.base import AttentionBackend
    from batchgen.engine.models.config import ModelConfig
    from batchgen.engine.parallel import TensorParallel


class Qwen3MoeForCausalLM(MoECausalLM):
    """HF's Qwen3MoeForCausalLM."""

    def __init__(self, cfg: ModelConfig, max_positions: int, attention_backend: AttentionBackend,
                 parallel: TensorParallel | None = None):
        refuse_sliding_window("Qwen3MoeForCausalLM", cfg.sliding_window, max_positions)
        super().__init__(cfg, max_positions, attention_backend, parallel)

    @classmethod
    def config_fields(cls, hf_config: dict) -> dict:
        return {**moe_config_fields(hf_config, num_experts_key="num_experts", moe_intermediate_key="moe_intermediate_size",
                                    renormalize=bool(hf_config.get("norm_topk_prob", False)),
                                    dense_layers=sparse_step_dense_layers(hf_config)),
                "qk_norm": True,
                # HF applies the window only with use_sliding_window (off in every published config)
                "sliding_window": hf_config.get("sliding_window") if hf_config.get("use_sliding_window") else None}


def sparse_step_dense_layers(hf_config: dict) -> tuple[int, ...]:
    """The layers HF's Qwen2/3-MoE build with a dense MLP: in mlp_only_layers, or (index + 1) not a multiple
    of decoder_sparse_step."""
    step = int(hf_config.get("decoder_sparse_step", 1) or 1)
    only = set(hf_config.get("mlp_only_layers") or [])
    return tuple(i for i in range(hf_config["num_hidden_layers"]) if i in only or (i + 1) % step != 0)
