"""Integer checkpoint formats: tensors written here by small independent packers, read back by batchgen.

Each packer follows its format's documented layout with plain Python integers (no torch bit ops,
not the reader run backwards). The float weights are (q - z) * s, which float32 holds exactly for
4/8-bit codes and float16 scales, so the reader's dequantize() must return them bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from batchgen.engine.quant.int_formats import (
    IntWeight,
    quantize_int4_groups,
    quantize_int8_per_channel,
    read_awq,
    read_gptq,
    read_int_quantized,
    read_pack_quantized,
)
from tests.engine.int_packers import Quantized, pack_awq, pack_ct, pack_gptq

# ---- GPTQ: qweight (K * bits / 32, N) packed along K; qzeros (G, N * bits / 32) packed along N ----

@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
def test_gptq_dequantizes_to_the_packed_float_weights(bits, group_size, checkpoint_format):
    # K = 200 is not a multiple of 32/64/128: the last group is short. v1 cannot store z = 0 (z - 1 = -1).
    w = Quantized(16, 200, bits, group_size, seed=bits + group_size,
                  zero_range=(1, (1 << bits) - 1) if checkpoint_format == "gptq" else None)
    t = pack_gptq(w, checkpoint_format)
    got = read_gptq(t["qweight"], t["qzeros"], t["scales"], bits=bits, group_size=group_size, g_idx=t["g_idx"],
                    checkpoint_format=checkpoint_format)
    assert got.bits == bits and got.g_idx is None  # a trivial g_idx is dropped
    assert torch.equal(got.dequantize(), w.float_weight())


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_act_order_with_shuffled_g_idx(bits):
    w = Quantized(16, 200, bits, 64, seed=7, act_order=True, zero_range=(1, (1 << bits) - 1))
    t = pack_gptq(w, "gptq")
    got = read_gptq(t["qweight"], t["qzeros"], t["scales"], bits=bits, group_size=64, g_idx=t["g_idx"])
    assert got.is_act_order
    assert torch.equal(got.dequantize(), w.float_weight())


def test_gptq_symmetric_v1_zeros_become_symmetric():
    # Symmetric AutoGPTQ checkpoints store 7 (= 8 - 1) in every 4-bit zero slot.
    w = Quantized(16, 128, 4, 64, seed=3, symmetric=True)
    t = pack_gptq(w, "gptq")
    got = read_gptq(t["qweight"], t["qzeros"], t["scales"], bits=4, group_size=64)
    assert got.is_symmetric
    assert torch.equal(got.dequantize(), w.float_weight())


def test_the_zero_convention_matters():
    w = Quantized(16, 128, 4, 64, seed=4, zero_range=(1, 15))
    t = pack_gptq(w, "gptq")
    wrong = read_gptq(t["qweight"], t["qzeros"], t["scales"], bits=4, group_size=64, checkpoint_format="gptq_v2")
    assert not torch.equal(wrong.dequantize(), w.float_weight())


# ---- AWQ GEMM: qweight (K, N / 8) and qzeros (G, N / 8) packed along N, nibble i = column [0,2,4,6,1,3,5,7][i] ----

@pytest.mark.parametrize("group_size", [32, 128, -1])
def test_awq_dequantizes_to_the_packed_float_weights(group_size):
    w = Quantized(24, 256, 4, group_size, seed=11)
    t = pack_awq(w)
    got = read_awq(t["qweight"], t["qzeros"], t["scales"], group_size=group_size)
    assert torch.equal(got.dequantize(), w.float_weight())


def test_awq_interleaving_is_not_the_identity():
    w = Quantized(16, 64, 4, 32, seed=12)
    t = pack_awq(w, order=list(range(8)))  # packed in plain column order: an AWQ reader must get it wrong
    got = read_awq(t["qweight"], t["qzeros"], t["scales"], group_size=32)
    assert not torch.equal(got.dequantize(), w.float_weight())


# ---- compressed-tensors: pack-quantized (N, ceil(K / per_word)) along K, signed + 2**(bits-1); int-quantized ----

@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("strategy", ["group", "channel"])
@pytest.mark.parametrize("symmetric", [True, False])
def test_pack_quantized_dequantizes_to_the_packed_float_weights(bits, strategy, symmetric):
    group_size = 64 if strategy == "group" else -1
    w = Quantized(20, 200, bits, group_size, seed=bits * 3 + symmetric, symmetric=symmetric)  # K=200: padded word
    t = pack_ct(w, with_zero_point=not symmetric)
    got = read_pack_quantized(t["weight_packed"], t["weight_scale"], t["weight_shape"], bits=bits,
                              weight_zero_point=t.get("weight_zero_point"),
                              group_size=group_size if strategy == "group" else None)
    assert got.is_symmetric == symmetric
    assert torch.equal(got.dequantize(), w.float_weight())


def test_pack_quantized_act_order_g_idx():
    w = Quantized(16, 192, 4, 64, seed=21, act_order=True, symmetric=True)
    t = pack_ct(w, with_zero_point=False)
    got = read_pack_quantized(t["weight_packed"], t["weight_scale"], t["weight_shape"], bits=4,
                              weight_g_idx=torch.tensor(w.group, dtype=torch.int32), group_size=64)
    assert got.is_act_order and torch.equal(got.dequantize(), w.float_weight())


@pytest.mark.parametrize("strategy", ["group", "channel", "tensor"])
def test_int_quantized_dequantizes_to_the_float_weights(strategy):
    group_size = {"group": 32, "channel": -1, "tensor": -1}[strategy]
    w = Quantized(8 if strategy != "tensor" else 1, 96, 8, group_size, seed=31, zero_range=(120, 136))
    signed = torch.tensor(w.q, dtype=torch.int16) - 128
    zp = torch.tensor(w.z, dtype=torch.int16) - 128
    got = read_int_quantized(signed.to(torch.int8), torch.from_numpy(w.s.copy()), weight_zero_point=zp.to(torch.int8),
                             group_size=group_size if strategy == "group" else None)
    assert torch.equal(got.dequantize(), w.float_weight())


@pytest.mark.parametrize("bits", [4, 8])
def test_the_ct_packer_agrees_with_compressed_tensors_own_packing(bits):
    # The package's pack_to_int32 takes signed int8 values (it adds 2**(bits-1) itself).
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    w = Quantized(20, 200, bits, 64, seed=40 + bits)  # N = 20: the packed zero points' last word is partial
    t = pack_ct(w, with_zero_point=True)
    offset = 1 << (bits - 1)
    signed_q = (torch.tensor(w.q, dtype=torch.int16) - offset).to(torch.int8)
    signed_z = (torch.tensor(w.z, dtype=torch.int16) - offset).to(torch.int8)
    assert torch.equal(pack_to_int32(signed_q, bits, packed_dim=1), t["weight_packed"])
    assert torch.equal(pack_to_int32(signed_z, bits, packed_dim=0), t["weight_zero_point"])


# ---- GGUF blocks kept quantized: decoded exactly as gguf's own dequantize ----

@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_decode_to_ggufs_own_dequantized_floats(type_name):
    import gguf
    import numpy as np

    from batchgen.engine.loader.gguf_blocks import decode_blocks

    qtype = gguf.GGMLQuantizationType[type_name]
    x = np.random.default_rng(5).standard_normal((24, 96)).astype(np.float32)
    raw = gguf.quants.quantize(x, qtype)  # (24, 3 blocks x bytes per block) uint8
    w = decode_blocks(raw, type_name, 24, 96)
    assert (w.bits, w.group_size, w.num_groups) == (8 if type_name == "Q8_0" else 4, 32, 3)
    assert (w.offsets is not None) == (type_name == "Q4_1")
    expected = torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32).reshape(24, 96))
    assert torch.equal(w.dequantize(), expected)



def test_a_fused_layer_is_kept_only_when_every_part_is(monkeypatch, caplog):
    """llama.cpp mixes types inside a layer: a Q6_K attn_k beside Q4_1 attn_q / attn_v sends the whole
    q/k/v layer to the float path (the model fuses them), while the other layers keep their blocks."""
    import logging
    from types import SimpleNamespace

    import gguf
    import numpy as np

    from batchgen.engine.loader import gguf_blocks, gguf_loader

    rng = np.random.default_rng(9)

    def tensor(base: str, type_name: str, layer: int = 0):
        raw = (gguf.quants.quantize(rng.standard_normal((16, 64)).astype(np.float32), gguf.GGMLQuantizationType[type_name])
               if type_name in gguf_blocks.KEPT_TYPES else np.zeros((16, 8), dtype=np.uint8))  # bytes never read
        return SimpleNamespace(name=f"blk.{layer}.{base}.weight", tensor_type=SimpleNamespace(name=type_name),
                               shape=(64, 16), data=raw)

    tensors = [tensor("attn_q", "Q4_1"), tensor("attn_k", "Q6_K"), tensor("attn_v", "Q4_1"),
               tensor("attn_output", "Q4_0"), tensor("ffn_gate", "Q8_0"), tensor("ffn_up", "Q4_1"),
               tensor("ffn_down", "Q5_K"), tensor("attn_q", "Q4_1", 1), tensor("attn_k", "Q4_1", 1),
               tensor("attn_v", "Q4_1", 1)]
    monkeypatch.setattr(gguf_loader, "_reader", lambda path: SimpleNamespace(tensors=tensors))
    with caplog.at_level(logging.INFO, logger="batchgen.engine"):
        kept = gguf_blocks.read_gguf_int_weights("unused.gguf", lambda name: name, lambda base, rows: None)
    # gate (Q8_0) and up (Q4_1) are both kept: they differ in bits, so they run as two parts.
    assert sorted(kept) == ["blk.0.attn_output", "blk.0.ffn_gate", "blk.0.ffn_up",
                            "blk.1.attn_k", "blk.1.attn_q", "blk.1.attn_v"]
    assert kept["blk.0.ffn_gate"].bits == 8 and kept["blk.0.attn_output"].bits == 4
    assert "2 Q4_1, 1 Q5_K, 1 Q6_K linear tensors have no kept-block form" in caplog.text

# ---- round-to-nearest at load ----

def test_int8_per_channel_round_trip():
    w = torch.randn(48, 200, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.1, 3, 48)[:, None]
    q = quantize_int8_per_channel(w)
    assert q.bits == 8 and q.is_symmetric and q.num_groups == 1
    err = (q.dequantize() - w).abs()
    assert bool((err <= q.scales.float() / 2 + 1e-6).all())
    assert int(q.signed_codes().abs().max()) == 127  # each row's largest weight lands on the top code


def test_int4_groups_round_trip_short_last_group():
    w = torch.randn(32, 300, generator=torch.Generator().manual_seed(1))
    q = quantize_int4_groups(w)
    assert q.bits == 4 and q.group_size == 128 and q.num_groups == 3 and not q.is_symmetric
    scale_per_col = q.scales[:, q.group_index()]
    assert bool(((q.dequantize() - w).abs() <= scale_per_col / 2 + 1e-6).all())


def test_inconsistent_tensors_are_refused():
    codes = torch.zeros(4, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="scale groups"):
        IntWeight(codes, torch.ones(4, 3), None, group_size=32, bits=4)
    with pytest.raises(ValueError, match="codes"):
        IntWeight(codes + 16, torch.ones(4, 2), None, group_size=32, bits=4)
    with pytest.raises(ValueError, match="g_idx"):
        IntWeight(codes, torch.ones(4, 2), None, group_size=32, bits=4, g_idx=torch.full((64,), 2))
