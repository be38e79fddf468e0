"""OLMo 2: the Llama decoder with its norms after attention and after the MLP instead of before, and
q/k RMSNorms over the whole q and k projections (not per head), applied before rope."""

from __future__ import annotations

from batchgen.engine.models.layers.causal_lm import CausalLM
from batchgen.engine.models.layers.post_norm_decoder import PostNormDecoderLayer


class Olmo2ForCausalLM(CausalLM):
    """HF's Olmo2ForCausalLM: post-norm blocks; q_norm / k_norm always there (config.json does not state
    them), q_size and kv_size wide; `attention_bias` puts a bias on o_proj as well as on q/k/v."""

    layer_class = PostNormDecoderLayer

    @classmethod
    def config_fields(cls, hf_config: dict) -> dict:
        activation = hf_config.get("hidden_act", "silu")
        if activation != "silu":  # the gated MLP (layers/mlp.py) is SiLU(gate) * up
            raise ValueError(f"OLMo 2 with hidden_act {activation!r} is not supported (silu only)")
        return {"qk_norm": True, "qk_norm_over_heads": True,
                "o_proj_bias": bool(hf_config.get("attention_bias", False))}
