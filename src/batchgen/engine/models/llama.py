"""Llama 2/3, SmolLM2 and Mistral: the shared pre-norm decoder as it is (layers/), rope-scaled or not."""

from __future__ import annotations

from batchgen.engine.models.layers.causal_lm import CausalLM


class LlamaForCausalLM(CausalLM):
    """HF's LlamaForCausalLM and MistralForCausalLM (a Mistral checkpoint is a Llama one)."""

    # llama.cpp stores Llama's q/k rows interleaved for its rope; the GGUF loader undoes it.
    is_gguf_qk_permuted = True
