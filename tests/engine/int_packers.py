"""Independent packers for the integer checkpoint formats, from each format's documented layout.

Plain Python integers (no torch bit ops, not batchgen's readers run backwards). The float weights
are (q - z) * s, which float32 holds exactly for 4/8-bit codes and float16 scales.
- GPTQ: qweight (K * bits / 32, N) packed along K; qzeros (G, N * bits / 32) packed along N; v1
  ("gptq") stores z - 1, v2 z itself; scales (G, N) float16; g_idx (K,).
- AWQ GEMM: qweight (K, N / 8) and qzeros (G, N / 8) packed along N, nibble i = column [0,2,4,6,1,3,5,7][i].
- compressed-tensors pack-quantized: (N, ceil(K / per_word)) along K, signed + 2**(bits-1); zero
  points (ceil(N / per_word), G) packed along N the same way.
"""

from __future__ import annotations

import random

import numpy as np
import torch


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


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def pack_awq(w: Quantized, order: list[int] = AWQ_ORDER) -> dict[str, torch.Tensor]:
    qweight = [[pack_word([w.q[c * 8 + order[i]][k] for i in range(8)], 4) for c in range(w.n // 8)]
               for k in range(w.k)]
    qzeros = [[pack_word([w.z[c * 8 + order[i]][g] for i in range(8)], 4) for c in range(w.n // 8)]
              for g in range(w.num_groups)]
    return {"qweight": torch.tensor(qweight, dtype=torch.int32), "qzeros": torch.tensor(qzeros, dtype=torch.int32),
            "scales": w.scales_gn()}


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
