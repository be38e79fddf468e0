"""Mistral (MistralForCausalLM): Llama's decoder with a sliding window over every layer.

HF's MistralConfig defaults `sliding_window` to 4,096 when config.json leaves the key out (Mistral 7B
v0.1 sets 4,096; v0.2 and later write null: no window); its mask lets a query see the last W positions,
itself included, in every layer. The engine reads it as HF does and masks in every attention backend.
"""

from __future__ import annotations

from batchgen.engine.models.llama import LlamaForCausalLM

# transformers' MistralConfig default for a config.json without the key.
_DEFAULT_SLIDING_WINDOW = 4096


class MistralForCausalLM(LlamaForCausalLM):
    """HF's MistralForCausalLM: a Llama checkpoint whose config may set a sliding window."""

    @classmethod
    def config_fields(cls, hf_config: dict) -> dict:
        return {"sliding_window": hf_config.get("sliding_window", _DEFAULT_SLIDING_WINDOW)}
