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


def tiny_config(vocab_size: int, eos_token_id: int | None, max_position_embeddings: int = 512, *,
                hidden: int = HIDDEN, intermediate: int = INTERMEDIATE, num_layers: int = NUM_LAYERS,
                num_heads: int = NUM_HEADS, num_kv_heads: int = NUM_KV_HEADS) -> dict:
    """The tiny model's config.json (alone, a folder whose limits `batchgen plan` and the job checks read).

    The keywords change the shape (head_dim = hidden / num_heads), e.g. to the bundled model's head_dim.
    """
    return {
        "model_type": "llama", "vocab_size": vocab_size, "hidden_size": hidden, "intermediate_size": intermediate,
        "num_hidden_layers": num_layers, "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
        "max_position_embeddings": max_position_embeddings, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": True, "eos_token_id": eos_token_id,
    }


def write_tiny_model(folder: Path, tokenizer, *, hidden: int = HIDDEN, intermediate: int = INTERMEDIATE,
                     num_layers: int = NUM_LAYERS, num_heads: int = NUM_HEADS,
                     num_kv_heads: int = NUM_KV_HEADS, weight_std: float = 0.02,
                     vocab_size: int | None = None) -> Path:
    """`tokenizer`: a transformers tokenizer (with its chat template) that the tiny model reuses.
    `weight_std`: the random weights' spread (larger: logits further from uniform, fewer near-ties).
    `vocab_size`: fewer logits than the tokenizer's vocabulary (a smaller lm_head; the model then
    writes only the first vocab_size tokens); None: the tokenizer's."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(folder)
    vocab = vocab_size or len(tokenizer)
    (folder / "config.json").write_text(json.dumps(tiny_config(
        vocab, tokenizer.eos_token_id, hidden=hidden, intermediate=intermediate, num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=num_kv_heads)))
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * weight_std

    head_dim = hidden // num_heads
    weights = {"model.embed_tokens.weight": rand(vocab, hidden), "model.norm.weight": torch.ones(hidden)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        weights.update({
            p + "self_attn.q_proj.weight": rand(num_heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": rand(num_kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": rand(num_kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, num_heads * head_dim),
            p + "mlp.gate_proj.weight": rand(intermediate, hidden),
            p + "mlp.up_proj.weight": rand(intermediate, hidden),
            p + "mlp.down_proj.weight": rand(hidden, intermediate),
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
        })
    save_file(weights, str(folder / "model.safetensors"))
    return folder
