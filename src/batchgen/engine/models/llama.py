"""Llama 2/3 and SmolLM2: the shared pre-norm decoder as it is (layers/), rope-scaled or not; Mistral
(mistral.py) is this class with its sliding window."""

from __future__ import annotations

from batchgen.engine.models.layers.causal_lm import CausalLM


class LlamaForCausalLM(CausalLM):
    """HF's LlamaForCausalLM (mistral.py's MistralForCausalLM builds on it)."""

    # llama.cpp stores Llama's q/k rows interleaved for its rope; the GGUF loader undoes it.
    is_gguf_qk_permuted = True
