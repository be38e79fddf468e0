"""gpt-oss (GptOssForCausalLM) as `batchgen plan` reads it: its shapes, for the capacity plan only. The
engine does not run gpt-oss yet (attention sinks, alternating sliding windows and the clamped SwiGLU are
still to come); building the model refuses it by name.

From config.json: num_local_experts routed experts (intermediate_size wide each; gate and up interleaved in
the checkpoint), num_experts_per_tok (older configs: experts_per_token) of them per token, a router with
a bias choosing the top k logits then taking the softmax over those (moe_router "topk_softmax"), biases
on every expert's projections and on q/k/v and o_proj (attention_bias). A quantization_config with
quant_method "mxfp4" (the published checkpoints: the experts only, router and attention excluded) plans
the experts' weights at their packed MXFP4 size (moe_expert_format); their biases stay bfloat16.
"""

from __future__ import annotations

from batchgen.engine.models.layers.causal_lm import CausalLM


class GptOssShapes(CausalLM):
    """Reads a gpt-oss config.json's shapes (config_fields); not a model the engine runs."""

    def __init__(self, *args, **kwargs):
        raise ValueError("architecture 'GptOssForCausalLM' is not supported yet (batchgen plan reads its shapes; "
                         "running it needs attention sinks, sliding windows and its clamped SwiGLU experts)")

    @classmethod
    def config_fields(cls, hf_config: dict) -> dict:
        num_experts = hf_config.get("num_local_experts", 128)
        top_k = hf_config.get("num_experts_per_tok", hf_config.get("experts_per_token", 4))
        bias = bool(hf_config.get("attention_bias", True))
        is_mxfp4 = (hf_config.get("quantization_config") or {}).get("quant_method") == "mxfp4"
        return {"moe_expert_format": "mxfp4" if is_mxfp4 else "","num_experts": num_experts, "num_experts_per_tok": top_k,
                "moe_intermediate_size": hf_config["intermediate_size"], "moe_router": "topk_softmax",
                "moe_router_bias": True, "moe_expert_bias": True, "attention_bias": bias, "o_proj_bias": bias,
                "moe_swiglu_limit": float(hf_config.get("swiglu_limit", 7.0)),
                "moe_swiglu_alpha": float(hf_config.get("swiglu_alpha", 1.702))}
