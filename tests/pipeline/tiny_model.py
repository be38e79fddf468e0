"""A tiny random-weight Llama in HF folder form, with the bundled model's tokenizer and chat template.

For tests that start `batchgen` in subprocesses: it loads in a second and decodes fast, so a test
can kill a run mid-job without waiting on the real model. Outputs are noise; ids and counts are not.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

HIDDEN, INTERMEDIATE, NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS = 32, 64, 2, 4, 2


def tiny_config(vocab_size: int, eos_token_id: int | None, max_position_embeddings: int = 512) -> dict:
    """The tiny model's config.json (alone, it is a model folder that `batchgen validate` can read)."""
    return {
        "model_type": "llama", "vocab_size": vocab_size, "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": NUM_LAYERS, "num_attention_heads": NUM_HEADS, "num_key_value_heads": NUM_KV_HEADS,
        "max_position_embeddings": max_position_embeddings, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": True, "eos_token_id": eos_token_id,
    }


def write_tiny_model(folder: Path, tokenizer) -> Path:
    """`tokenizer`: a transformers tokenizer (with its chat template) that the tiny model reuses."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(folder)
    vocab = len(tokenizer)
    (folder / "config.json").write_text(json.dumps(tiny_config(vocab, tokenizer.eos_token_id)))
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    head_dim = HIDDEN // NUM_HEADS
    weights = {"model.embed_tokens.weight": rand(vocab, HIDDEN), "model.norm.weight": torch.ones(HIDDEN)}
    for i in range(NUM_LAYERS):
        p = f"model.layers.{i}."
        weights.update({
            p + "self_attn.q_proj.weight": rand(NUM_HEADS * head_dim, HIDDEN),
            p + "self_attn.k_proj.weight": rand(NUM_KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.v_proj.weight": rand(NUM_KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.o_proj.weight": rand(HIDDEN, NUM_HEADS * head_dim),
            p + "mlp.gate_proj.weight": rand(INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": rand(INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": rand(HIDDEN, INTERMEDIATE),
            p + "input_layernorm.weight": torch.ones(HIDDEN),
            p + "post_attention_layernorm.weight": torch.ones(HIDDEN),
        })
    save_file(weights, str(folder / "model.safetensors"))
    return folder
