"""IntWeight: the one internal form of an integer-quantized linear weight, whatever checkpoint it came from.

    w[n, k] = (q[n, k] - z[n, g(k)]) * s[n, g(k)] (+ m[n, g(k)] for formats with float minima)

- q: unsigned codes in [0, 2**bits), one uint8 per weight (the readers unpack the formats' int32 words);
  signed formats are shifted by 2**(bits-1) (int8 -5 becomes code 123).
- z: integer zero points in code units, (N, G); None means symmetric, z = 2**(bits-1) everywhere.
  int16 because AutoGPTQ's "minus one" zeros read back as 1..2**bits (one past the code range).
- s: (N, G) scales in the checkpoint's dtype (float16, bfloat16 or float32), kept as stored.
- m: optional (N, G) float minima added after the scale, for formats whose offset is not an integer
  number of steps (GGUF Q4_1: w = d * q + m, i.e. z = 0, s = d, m = m); None for every other format.
- g(k): k // group_size, or g_idx[k] for act-order checkpoints whose columns were quantized out of order.

Dequantizing computes (q - z) in float32 and multiplies by the float32 scale: every term is exact for
4- and 8-bit codes, so a checkpoint's float weights come back bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_BITS = (4, 8)


@dataclass
class IntWeight:
    """An integer weight (N, K) with group-wise scales and optional zero points (see the module docstring)."""

    qweight: torch.Tensor  # (N, K) uint8 codes in [0, 2**bits)
    scales: torch.Tensor  # (N, G) float16 / bfloat16 / float32
    zeros: torch.Tensor | None  # (N, G) int16 codes, or None: symmetric (2**(bits-1))
    group_size: int  # columns per group; K for one group per output channel
    bits: int
    g_idx: torch.Tensor | None = None  # (K,) int32 group of each input column; None: k // group_size
    offsets: torch.Tensor | None = None  # (N, G) float minima added after the scale (GGUF Q4_1), or None

    def __post_init__(self) -> None:
        self.validate()
        self._normalize()

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def num_groups(self) -> int:
        return self.scales.shape[1]

    @property
    def midpoint(self) -> int:
        return 1 << (self.bits - 1)

    @property
    def is_symmetric(self) -> bool:
        return self.zeros is None

    @property
    def is_act_order(self) -> bool:
        return self.g_idx is not None

    def group_index(self) -> torch.Tensor:
        """(K,) int64: the group of each input column."""
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.in_features, device=self.qweight.device) // self.group_size

    def zero_points(self) -> torch.Tensor:
        """(N, G) int16 zero points, the symmetric midpoint filled in."""
        if self.zeros is not None:
            return self.zeros
        return torch.full_like(self.scales, self.midpoint, dtype=torch.int16)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(N, K) float weight: (q - z) * s computed in float32, then cast to dtype."""
        groups = self.group_index()
        q = self.qweight.float()
        z = self.zero_points().float()[:, groups]  # (N, K)
        s = self.scales.float()[:, groups]  # (N, K)
        w = (q - z) * s
        if self.offsets is not None:
            w = w + self.offsets.float()[:, groups]
        return w.to(dtype)

    def signed_codes(self) -> torch.Tensor:
        """(N, K) int8: q - 2**(bits-1), the codes of a symmetric weight as signed integers."""
        return (self.qweight.to(torch.int16) - self.midpoint).to(torch.int8)

    def num_bytes(self) -> int:
        """Bytes of the weight as a kernel holds it: bits/8 per code, the scales, zeros and g_idx."""
        total = self.qweight.numel() * self.bits // 8 + self.scales.numel() * self.scales.element_size()
        if self.zeros is not None:
            total += self.zeros.numel() * (1 if self.bits <= 8 and int(self.zeros.max()) < 256 else 2)
        if self.g_idx is not None:
            total += self.g_idx.numel() * 4
        if self.offsets is not None:
            total += self.offsets.numel() * self.offsets.element_size()
        return total

    def validate(self) -> None:
        """Raise ValueError when the tensors do not describe one consistent weight."""
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"integer weights must have {' or '.join(map(str, SUPPORTED_BITS))} bits, got {self.bits}")
        if self.qweight.dim() != 2 or self.qweight.dtype != torch.uint8:
            raise ValueError(f"qweight must be (N, K) uint8 codes, got {self.qweight.dtype} {tuple(self.qweight.shape)}")
        n, k = self.qweight.shape
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1 (K for per-channel), got {self.group_size}")
        if self.scales.dim() != 2 or self.scales.shape[0] != n or not self.scales.is_floating_point():
            raise ValueError(f"scales must be (N={n}, G) float, got {self.scales.dtype} {tuple(self.scales.shape)}")
        num_groups = self.scales.shape[1]
        if self.g_idx is None and num_groups != -(-k // self.group_size):
            raise ValueError(f"{num_groups} scale groups for K={k} and group_size {self.group_size}; "
                             f"expected {-(-k // self.group_size)}")
        if self.qweight.numel() and int(self.qweight.max()) >= 1 << self.bits:
            raise ValueError(f"qweight holds codes >= 2**{self.bits}")
        if self.zeros is not None:
            if self.zeros.shape != self.scales.shape:
                raise ValueError(f"zeros {tuple(self.zeros.shape)} and scales {tuple(self.scales.shape)} differ in shape")
            if self.zeros.numel() and (int(self.zeros.min()) < 0 or int(self.zeros.max()) > 1 << self.bits):
                raise ValueError(f"zero points outside [0, 2**{self.bits}]")
        if self.offsets is not None and (self.offsets.shape != self.scales.shape
                                         or not self.offsets.is_floating_point()):
            raise ValueError(f"offsets must be float like the scales {tuple(self.scales.shape)}, "
                             f"got {self.offsets.dtype} {tuple(self.offsets.shape)}")
        if self.g_idx is not None:
            if self.g_idx.shape != (k,):
                raise ValueError(f"g_idx must have K={k} entries, got {tuple(self.g_idx.shape)}")
            if k and (int(self.g_idx.min()) < 0 or int(self.g_idx.max()) >= num_groups):
                raise ValueError(f"g_idx refers to groups outside [0, {num_groups})")

    def _normalize(self) -> None:
        # One form per meaning, so kernels can test for the cheap cases: zeros all at the midpoint are
        # symmetric; a g_idx equal to k // group_size (desc_act false checkpoints store one) is no act-order.
        self.zeros = None if self.zeros is None else self.zeros.to(torch.int16)
        if self.zeros is not None and bool((self.zeros == self.midpoint).all()):
            self.zeros = None
        if self.g_idx is not None:
            self.g_idx = self.g_idx.to(torch.int32)
            k = self.in_features
            trivial = torch.arange(k, device=self.g_idx.device) // self.group_size
            if self.num_groups == -(-k // self.group_size) and torch.equal(self.g_idx.long(), trivial):
                self.g_idx = None


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order: list[int] | None = None) -> torch.Tensor:
    """Split each int32 word of `packed` into 32 // bits unsigned codes along `dim` -> uint8.

    Word w along dim holds codes w * per_word + i at bits [i * bits, (i + 1) * bits), lowest first;
    `order[j]` = the slot of the j-th code of a word, for layouts that interleave (AWQ).
    """
    if packed.dtype != torch.int32:
        raise ValueError(f"packed integer weights must be int32 words, got {packed.dtype}")
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)  # (per_word,)
    moved = packed.movedim(dim, -1).unsqueeze(-1)  # (..., W, 1)
    codes = (moved >> shifts) & ((1 << bits) - 1)  # (..., W, per_word); & drops the sign extension of >>
    if order is not None:
        codes = codes[..., order]
    codes = codes.reshape(*moved.shape[:-2], -1).to(torch.uint8)  # (..., W * per_word)
    return codes.movedim(-1, dim)


def num_groups_for(in_features: int, group_size: int) -> int:
    """Groups along K: ceil(K / group_size); a group_size of -1 (or <= 0) means one group per channel."""
    return 1 if group_size <= 0 else -(-in_features // group_size)


def resolve_group_size(in_features: int, group_size: int) -> int:
    """-1 (per output channel) -> K; anything else as given."""
    return in_features if group_size <= 0 else group_size


def select_rows(w: IntWeight, index: torch.Tensor) -> IntWeight:
    """The weight's output rows in `index` order (GGUF's q/k row permutation acts on whole rows)."""
    def pick(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.index_select(0, index).contiguous()

    return IntWeight(qweight=pick(w.qweight), scales=pick(w.scales), zeros=pick(w.zeros), group_size=w.group_size,
                     bits=w.bits, g_idx=w.g_idx, offsets=pick(w.offsets))


def concat_out_features(parts: list[IntWeight]) -> IntWeight | None:
    """q/k/v or gate/up stacked along the output dim as one weight; None when the parts cannot share
    one layout (bit widths, group sizes or act-order permutations differ): then they stay separate."""
    first = parts[0]
    for p in parts[1:]:
        if (p.bits, p.group_size, p.in_features, p.num_groups) != (first.bits, first.group_size, first.in_features,
                                                                   first.num_groups):
            return None
        if (p.g_idx is None) != (first.g_idx is None) or (p.g_idx is not None and not torch.equal(p.g_idx, first.g_idx)):
            return None
    scale_dtype = first.scales.dtype if all(p.scales.dtype == first.scales.dtype for p in parts) else torch.float32
    zeros = None
    if any(p.zeros is not None for p in parts):
        zeros = torch.cat([p.zero_points() for p in parts])
    offsets = None
    if any(p.offsets is not None for p in parts):
        offsets = torch.cat([p.offsets.float() if p.offsets is not None else torch.zeros_like(p.scales, dtype=torch.float32)
                             for p in parts])
    return IntWeight(qweight=torch.cat([p.qweight for p in parts]),
                     scales=torch.cat([p.scales.to(scale_dtype) for p in parts]), zeros=zeros,
                     group_size=first.group_size, bits=first.bits, g_idx=first.g_idx, offsets=offsets)
