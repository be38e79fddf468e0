"""Integer checkpoint formats: tensors written here by small independent packers, read back by batchgen.

Each packer follows its format's documented layout with plain Python integers (no torch bit ops,
not the reader run backwards). The float weights are (q - z) * s, which float32 holds exactly for
4/8-bit codes and float16 scales, so the reader's dequantize() must return them bit for bit.
"""

from __future__ import annotations

import random

import numpy as np
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


def int32(word: int) -> int:
    """A 32-bit word as the signed int32 a safetensors file stores."""
    return word - (1 << 32) if word >= 1 << 31 else word


def pack_word(values: list[int], bits: int) -> int:
    """values[i] in bits [i * bits, (i + 1) * bits) of one word, lowest first."""
    word = 0
    for i, v in enumerate(values):
        word |= (v & ((1 << bits) - 1)) << (bits * i)
    return int32(word)


class Quantized:
    """Random codes q (N, K), zeros z (N, G), float16 scales s (N, G), group of each column, float weight."""

    def __init__(self, n: int, k: int, bits: int, group_size: int, seed: int, act_order: bool = False,
                 zero_range: tuple[int, int] | None = None, symmetric: bool = False):
        rng = random.Random(seed)
        self.n, self.k, self.bits = n, k, bits
        self.group_size = k if group_size == -1 else group_size
        self.num_groups = -(-k // self.group_size)
        if act_order:
            # As GPTQ writes it: columns quantized in a permuted order, g_idx[perm[i]] = i // group_size.
            perm = list(range(k))
            rng.shuffle(perm)
            self.group = [0] * k
            for i, col in enumerate(perm):
                self.group[col] = i // self.group_size
        else:
            self.group = [col // self.group_size for col in range(k)]
        top = (1 << bits) - 1
        lo, hi = zero_range or (0, top)
        mid = 1 << (bits - 1)
        self.q = [[rng.randint(0, top) for _ in range(k)] for _ in range(n)]
        self.z = [[mid if symmetric else rng.randint(lo, hi) for _ in range(self.num_groups)] for _ in range(n)]
        self.s = np.array([[rng.uniform(0.001, 0.05) for _ in range(self.num_groups)] for _ in range(n)],
                          dtype=np.float16)

    def float_weight(self) -> torch.Tensor:
        w = np.zeros((self.n, self.k), dtype=np.float64)
        for r in range(self.n):
            for c in range(self.k):
                g = self.group[c]
                w[r, c] = (self.q[r][c] - self.z[r][g]) * float(self.s[r, g])
        return torch.from_numpy(w.astype(np.float32))

    def scales_gn(self) -> torch.Tensor:  # (G, N) float16, as GPTQ and AWQ store them
        return torch.from_numpy(np.ascontiguousarray(self.s.T))


# ---- GPTQ: qweight (K * bits / 32, N) packed along K; qzeros (G, N * bits / 32) packed along N ----

def pack_gptq(w: Quantized, checkpoint_format: str) -> dict[str, torch.Tensor]:
    per_word = 32 // w.bits
    qweight = [[pack_word([w.q[n][r * per_word + i] for i in range(per_word)], w.bits) for n in range(w.n)]
               for r in range(w.k // per_word)]
    # v1 ("gptq") stores z - 1 (masked to the bit width); v2 stores z.
    minus = 1 if checkpoint_format == "gptq" else 0
    qzeros = [[pack_word([w.z[c * per_word + i][g] - minus for i in range(per_word)], w.bits)
               for c in range(w.n // per_word)] for g in range(w.num_groups)]
    return {"qweight": torch.tensor(qweight, dtype=torch.int32), "qzeros": torch.tensor(qzeros, dtype=torch.int32),
            "scales": w.scales_gn(), "g_idx": torch.tensor(w.group, dtype=torch.int32)}


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

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def pack_awq(w: Quantized, order: list[int] = AWQ_ORDER) -> dict[str, torch.Tensor]:
    qweight = [[pack_word([w.q[c * 8 + order[i]][k] for i in range(8)], 4) for c in range(w.n // 8)]
               for k in range(w.k)]
    qzeros = [[pack_word([w.z[c * 8 + order[i]][g] for i in range(8)], 4) for c in range(w.n // 8)]
              for g in range(w.num_groups)]
    return {"qweight": torch.tensor(qweight, dtype=torch.int32), "qzeros": torch.tensor(qzeros, dtype=torch.int32),
            "scales": w.scales_gn()}


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

def pack_ct(w: Quantized, with_zero_point: bool) -> dict[str, torch.Tensor]:
    per_word = 32 // w.bits
    words_per_row = -(-w.k // per_word)
    # The codes q are already value + offset (compressed-tensors' unsigned storage); pad with 0.
    rows = [row + [0] * (words_per_row * per_word - w.k) for row in w.q]
    packed = [[pack_word(row[i * per_word:(i + 1) * per_word], w.bits) for i in range(words_per_row)] for row in rows]
    out = {"weight_packed": torch.tensor(packed, dtype=torch.int32), "weight_shape": torch.tensor([w.n, w.k]),
           "weight_scale": torch.from_numpy(w.s.copy())}
    if with_zero_point:
        # Zero points packed along the output dim: (ceil(N / per_word), G).
        zrows = -(-w.n // per_word)
        out["weight_zero_point"] = torch.tensor(
            [[pack_word([w.z[r * per_word + i][g] if r * per_word + i < w.n else 0 for i in range(per_word)], w.bits)
              for g in range(w.num_groups)] for r in range(zrows)], dtype=torch.int32)
    return out


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
