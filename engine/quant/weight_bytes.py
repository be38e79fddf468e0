"""Weight bytes from the architecture alone (no weights read), FP8 included: what `batchgen plan` can print.

It counts what the loaded model holds, so it equals the engine's measurement from tensor storage:
FP8 linear layers hold 1 byte per weight plus one float32 scale per output channel; embeddings,
norms, biases and (unless quantize_lm_head) lm_head stay in the model dtype; a tied lm_head shares
the embedding's storage, but an FP8 lm_head is a copy of its own.
"""

from __future__ import annotations

import torch

from batchgen.engine.models.config import ModelConfig

FP8_SCALE_BYTES = 4  # float32, one per output channel


def linear_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(out_features, in_features) of one decoder layer's fused linear layers."""
    return [(cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size), (cfg.hidden_size, cfg.q_size),
            (2 * cfg.intermediate_size, cfg.hidden_size), (cfg.hidden_size, cfg.intermediate_size)]


def estimate_weight_bytes(cfg: ModelConfig, dtype: torch.dtype, quantization: str = "none",
                          quantize_lm_head: bool = False) -> int:
    """Bytes of the model's weights as loaded (rotary tables excluded), for quantization none or fp8."""
    elem = torch.empty((), dtype=dtype).element_size()
    is_fp8 = quantization == "fp8"

    def linear_bytes(out_features: int, in_features: int, quantized: bool) -> int:
        if quantized:
            return out_features * in_features + out_features * FP8_SCALE_BYTES
        return out_features * in_features * elem

    per_layer = sum(linear_bytes(n, k, is_fp8) for n, k in linear_shapes(cfg))
    per_layer += 2 * cfg.hidden_size * elem  # input and post-attention norms
    if cfg.attention_bias:
        per_layer += (cfg.q_size + 2 * cfg.kv_size) * elem
    if cfg.qk_norm:
        per_layer += 2 * cfg.head_dim * elem
    total = cfg.num_layers * per_layer + cfg.vocab_size * cfg.hidden_size * elem + cfg.hidden_size * elem
    is_lm_head_fp8 = is_fp8 and quantize_lm_head
    if is_lm_head_fp8 or not cfg.tie_word_embeddings:
        total += linear_bytes(cfg.vocab_size, cfg.hidden_size, is_lm_head_fp8)
    return total
