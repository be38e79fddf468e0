"""Which slice of the model each tensor-parallel rank holds, and reading only that slice (no processes).

Layouts: whole KV groups as evenly as they split (the bundled model's 3 KV heads over 2 ranks: 1 + 2),
KV heads replicated past num_kv_heads (vLLM's rule), a size that leaves a rank without a query head
refused. Shards: the GGUF reader's rows and whole-block columns against the whole tensor dequantized
and cut; safetensors slices against the whole tensor; integer weights' rows and group-aligned columns
against the dequantized whole, and a column slice through a group refused.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from batchgen.engine.config import EngineConfig, SettingError
from batchgen.engine.models.config import ModelConfig
from batchgen.engine.parallel.layout import (
    Shard,
    TensorParallelLayout,
    all_layouts,
    check_can_split,
    pad_rows,
)
from batchgen.engine.parallel.shards import gguf_shard_array, read_safetensors, shard_int_weight
from batchgen.engine.quant.int_formats import quantize_int4_groups, quantize_int8_per_channel

SMOLLM = ModelConfig(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                     num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5,
                     max_position_embeddings=8192, tie_word_embeddings=True)
LLAMA_70B = dataclasses.replace(SMOLLM, vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                                num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128, tie_word_embeddings=False)


def spans(layouts, field):
    return [getattr(layout, field) for layout in layouts]


def test_whole_kv_groups_as_even_as_they_split():
    two = all_layouts(SMOLLM, 2)
    assert spans(two, "kv_heads") == [(0, 1), (1, 3)]
    assert spans(two, "query_heads") == [(0, 3), (3, 9)]
    assert spans(two, "intermediate") == [(0, 768), (768, 1536)]
    assert spans(two, "vocab") == [(0, 24576), (24576, 49152)]
    eight = all_layouts(LLAMA_70B, 8)
    assert spans(eight, "kv_heads") == [(i, i + 1) for i in range(8)]
    assert spans(eight, "query_heads") == [(8 * i, 8 * i + 8) for i in range(8)]
    three = all_layouts(LLAMA_70B, 3)  # uneven: 2 + 3 + 3 KV heads, the vocabulary padded to 3 x 42752
    assert spans(three, "kv_heads") == [(0, 2), (2, 5), (5, 8)]
    assert spans(three, "vocab") == [(0, 42752), (42752, 85504), (85504, 128256)]
    assert sum(layout.num_intermediate for layout in three) == 28672


def test_past_the_kv_heads_each_rank_holds_one_kv_head_and_a_share_of_its_query_heads():
    sixteen = all_layouts(LLAMA_70B, 16)
    assert spans(sixteen, "kv_heads") == [(i // 2, i // 2 + 1) for i in range(16)]  # each KV head on 2 ranks
    assert spans(sixteen, "query_heads") == [(4 * i, 4 * i + 4) for i in range(16)]
    six = all_layouts(SMOLLM, 6)  # 3 KV heads on 2 ranks each; their 3 query heads split 1 + 2
    assert spans(six, "kv_heads") == [(0, 1), (0, 1), (1, 2), (1, 2), (2, 3), (2, 3)]
    assert spans(six, "query_heads") == [(0, 1), (1, 3), (3, 4), (4, 6), (6, 7), (7, 9)]
    assert all(layout.rank_config(SMOLLM).num_kv_heads == 1 for layout in six)


def test_a_size_that_leaves_a_rank_without_a_query_head_is_refused():
    check_can_split(SMOLLM, 9)
    with pytest.raises(ValueError, match="tensor_parallel_size 10 leaves a rank without a query head: "
                                         "the model has 9 query heads over 3 KV heads"):
        check_can_split(SMOLLM, 10)
    with pytest.raises(SettingError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(model="m", tensor_parallel_size=0)


def test_checkpoint_tensors_split_along_their_layers_axes():
    rank1 = TensorParallelLayout.plan(SMOLLM, 1, 2)
    assert rank1.shard("model.layers.0.self_attn.q_proj.weight", (576, 576)) == Shard(0, 192, 576, 384)
    assert rank1.shard("model.layers.0.self_attn.k_proj.bias", (192,)) == Shard(0, 64, 192, 128)
    assert rank1.shard("model.layers.0.self_attn.o_proj.weight", (576, 576)) == Shard(1, 192, 576, 384)
    assert rank1.shard("model.layers.0.mlp.up_proj.weight", (1536, 576)) == Shard(0, 768, 1536, 768)
    assert rank1.shard("model.layers.0.mlp.down_proj.weight", (576, 1536)) == Shard(1, 768, 1536, 768)
    assert rank1.shard("model.embed_tokens.weight", (49152, 576)) == Shard(0, 24576, 49152, 24576)
    # Per-channel scales follow a column-parallel layer's rows; a row-parallel layer keeps its
    # per-output scales whole, and per-tensor scales and norms are held whole everywhere.
    assert rank1.shard("model.layers.0.mlp.gate_proj.weight_scale", (1536, 1)) == Shard(0, 768, 1536, 768)
    assert rank1.shard("model.layers.0.mlp.down_proj.weight_scale", (576,)) is None
    assert rank1.shard("model.layers.0.self_attn.q_proj.weight_scale", (1,)) is None
    assert rank1.shard("model.layers.0.input_layernorm.weight", (576,)) is None
    last = TensorParallelLayout.plan(LLAMA_70B, 2, 3)  # the vocabulary's last slice, zero-padded
    assert last.shard("lm_head.weight", (128256, 8192)) == Shard(0, 85504, 128256, 42752)
    assert pad_rows(torch.arange(4.0).reshape(2, 2), 4).tolist() == [[0, 1], [2, 3], [0, 0], [0, 0]]


def test_a_checkpoint_stored_fused_is_held_whole_and_cut_by_the_model_s_rows():
    """Phi-3's qkv_proj and gate_up_proj: a rank's rows are three (two) ranges, cut by the model."""
    rank1 = TensorParallelLayout.plan(SMOLLM, 1, 2)  # query heads 3..9, KV heads 1..3, channels 768..1536
    assert rank1.fused_rows("qkv_proj") == [(192, 576), (576 + 64, 576 + 192), (768 + 64, 768 + 192)]
    assert rank1.fused_rows("gate_up_proj") == [(768, 1536), (1536 + 768, 3072)]
    assert rank1.fused_rows("q_proj") is None
    assert rank1.shard("model.layers.0.self_attn.qkv_proj.weight", (960, 576)) is None
    assert rank1.shard("model.layers.0.mlp.gate_up_proj.weight_scale", (1,)) is None  # per tensor
    with pytest.raises(ValueError, match="qkv_proj.weight_scale'.*already-fused"):
        rank1.shard("model.layers.0.self_attn.qkv_proj.weight_scale", (960, 1))


def test_gguf_slices_equal_the_whole_tensor_dequantized_and_cut(smollm_path):
    from batchgen.engine.loader.gguf_loader import _reader

    tensors = {t.name: t for t in _reader(smollm_path).tensors}
    down = tensors["blk.0.ffn_down.weight"]  # Q4_1 (576, 1536)
    whole = gguf_shard_array(down, None)
    assert whole.shape == (576, 1536)
    for spec in (Shard(0, 100, 300, 200), Shard(1, 768, 1536, 768), Shard(1, 100, 300, 200)):
        part = gguf_shard_array(down, spec)  # rows, whole blocks of columns, and a cut through blocks
        expected = whole[spec.start:spec.end] if spec.dim == 0 else whole[:, spec.start:spec.end]
        np.testing.assert_array_equal(part, expected)
    embed = tensors["token_embd.weight"]  # Q8_0 (49152, 576): the vocabulary's rows only
    np.testing.assert_array_equal(gguf_shard_array(embed, Shard(0, 24576, 24600, 24)),
                                  gguf_shard_array(embed, None)[24576:24600])


def test_safetensors_slices_read_only_the_rank_s_part(tmp_path):
    weight = torch.randn(12, 8)
    save_file({"model.layers.0.mlp.down_proj.weight": weight, "model.norm.weight": torch.ones(8)},
              tmp_path / "w.safetensors")
    layout = TensorParallelLayout.plan(dataclasses.replace(SMOLLM, intermediate_size=8), 1, 2)
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        part = read_safetensors(f, "model.layers.0.mlp.down_proj.weight", layout.shard)
        norm = read_safetensors(f, "model.norm.weight", layout.shard)
    assert torch.equal(part, weight[:, 4:8]) and torch.equal(norm, torch.ones(8))


def test_integer_weights_split_on_rows_and_group_boundaries():
    w = torch.randn(16, 256)
    int4 = quantize_int4_groups(w, group_size=64, scale_dtype=torch.float32)
    whole = int4.dequantize()
    assert torch.equal(shard_int_weight(int4, Shard(0, 4, 12, 8), "l").dequantize(), whole[4:12])
    assert torch.equal(shard_int_weight(int4, Shard(1, 128, 256, 128), "l").dequantize(), whole[:, 128:])
    with pytest.raises(ValueError, match=r"layer x: this rank's input columns 96\.\.256 cut a group of 64 columns"):
        shard_int_weight(int4, Shard(1, 96, 256, 160), "layer x")
    int8 = quantize_int8_per_channel(w, torch.float32)  # one group per row: any slice keeps the row's scale
    assert torch.equal(shard_int_weight(int8, Shard(1, 96, 256, 160), "l").dequantize(), int8.dequantize()[:, 96:])


def test_serve_and_llm_take_the_setting():
    from batchgen.cli.serve import parse_serve_flags

    assert parse_serve_flags(["m", "--tensor-parallel-size", "2"]).engine_config().tensor_parallel_size == 2
    with pytest.raises(ValueError, match="--tensor-parallel-size must be >= 1"):
        parse_serve_flags(["m", "--tensor-parallel-size", "0"]).engine_config()
    with pytest.raises(ValueError, match="cannot take a built model"):
        from batchgen.engine import LLMEngine

        LLMEngine(EngineConfig(model="m", tensor_parallel_size=2), loaded=object())


def test_gguf_kept_blocks_split_like_the_whole_file(smollm_path):
    """quantization: gguf over 2 ranks: rank 1's q rows (llama.cpp's q/k row order undone over its own
    6 heads) and its o_proj and ffn_down columns (whole blocks of 32) equal the whole file's, cut."""
    from batchgen.engine.loader.gguf_blocks import read_gguf_int_weights
    from batchgen.engine.loader.gguf_loader import hf_tensor_name, read_gguf_config, row_permutation

    cfg = read_gguf_config(smollm_path)
    layout = TensorParallelLayout.plan(cfg, 1, 2)
    rank_cfg = layout.rank_config(cfg)
    whole = read_gguf_int_weights(smollm_path, hf_tensor_name, lambda base, rows: row_permutation(cfg, base, rows))
    mine = read_gguf_int_weights(smollm_path, hf_tensor_name,
                                 lambda base, rows: row_permutation(rank_cfg, base, rows), layout.shard)
    assert mine.keys() == whole.keys()
    for name, rows, columns in (("model.layers.3.self_attn.q_proj", slice(192, 576), slice(None)),
                                ("model.layers.3.self_attn.k_proj", slice(64, 192), slice(None)),
                                ("model.layers.3.self_attn.o_proj", slice(None), slice(192, 576)),
                                ("model.layers.3.mlp.down_proj", slice(None), slice(768, 1536))):
        assert torch.equal(mine[name].dequantize(), whole[name].dequantize()[rows, columns]), name
