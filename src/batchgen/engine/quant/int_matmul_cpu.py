"""Weight-only integer matmuls for the CPU: y (M, N) = x (M, K) @ dequantize(IntWeight)^T, float32 activations.

Three kernels, each preparing its own copy of the weight once (at construction) and then only
multiplying:
- Int8PackKernel: torch's _weight_int8pack_mm (signed int8 codes, one scale per output channel).
  Per-channel zero points become one correction per output: x @ ((q - z) s)^T = x @ (q s)^T - sum(x) (z s).
- Int4PackKernel: torch's _weight_int4pack_mm_for_cpu (groups of 32/64/128/256, N a multiple of 16).
  Its dequantization is (q - 8) * scale + zero, so (q - z) * s is stored as zero = (8 - z) * s.
  Act-order weights run with their input columns sorted by group (x is permuted per call); a K that is
  not a multiple of the group is padded with zero columns (x too).
- DequantKernel: any IntWeight. Unpacks and dequantizes a tile of output rows at a time into float32
  and multiplies it with one GEMM, so the float tile stays in cache and no float copy of the whole
  weight is kept.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchgen.engine.quant.int_formats.int_weight import IntWeight

INT4PACK_GROUP_SIZES = (32, 64, 128, 256)
DEQUANT_TILE_BYTES = 1 << 20  # float32 tile of the weight dequantized per GEMM: fits L2 on common CPUs


class Int8PackKernel:
    supported_bits = (8,)
    name = "int8pack"

    @staticmethod
    def can_run(w: IntWeight) -> bool:
        return w.bits == 8 and w.num_groups == 1 and not w.is_act_order and w.offsets is None

    def __init__(self, w: IntWeight, shared: dict | None = None):
        shared = {} if shared is None else shared
        self.weight = signed_codes(w, shared)  # (N, K) int8, the same tensor the dequant kernel reads
        self.scale = float_scales(w, shared).reshape(-1)  # (N,), a view of the dequant kernel's (N, 1)
        # -(z - 128) * s per output channel (the dequant kernel's -z*s table), or None for symmetric weights.
        neg_zs = int8_neg_zs(w, shared)
        self.neg_zs = None if neg_zs is None else neg_zs.reshape(-1)  # (N,)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # (M, K) float32 -> (M, N)
        y = torch._weight_int8pack_mm(x, self.weight, self.scale)
        if self.neg_zs is not None:  # x @ ((q - z) s)^T = x @ ((q - 128) s)^T - sum(x) (z - 128) s
            y = y + x.sum(dim=1, keepdim=True) * self.neg_zs
        return y

    def num_bytes(self) -> int:
        extra = 0 if self.neg_zs is None else self.neg_zs.numel() * 4
        return self.weight.numel() + self.scale.numel() * 4 + extra


def float_scales(w: IntWeight, shared: dict) -> torch.Tensor:
    """(N, G) float32 scales, made once per layer."""
    if "scale" not in shared:
        shared["scale"] = w.scales.float().contiguous()
    return shared["scale"]


def int8_neg_zs(w: IntWeight, shared: dict) -> torch.Tensor | None:
    """(N, G) float32 -(z - 128) * s (+ minima) of an 8-bit weight, None when that is 0; made once per layer."""
    if "neg_zs8" not in shared:
        scale = float_scales(w, shared)
        neg_zs = None if w.zeros is None else -(w.zeros.float() - w.midpoint) * scale
        if w.offsets is not None:
            neg_zs = w.offsets.float() if neg_zs is None else neg_zs + w.offsets.float()
        shared["neg_zs8"] = None if neg_zs is None else neg_zs.contiguous()
    return shared["neg_zs8"]


def signed_codes(w: IntWeight, shared: dict | None) -> torch.Tensor:
    """(N, K) int8 codes - 128 of an 8-bit weight, made once per layer: kernels of one plan share it."""
    shared = {} if shared is None else shared
    if "signed_codes" not in shared:
        shared["signed_codes"] = w.signed_codes().contiguous()
    return shared["signed_codes"]


class Int4PackKernel:
    supported_bits = (4,)
    name = "int4pack"

    @staticmethod
    def can_run(w: IntWeight) -> bool:
        if w.bits != 4 or w.out_features % 16:
            return False
        return _int4pack_layout(w) is not None

    def __init__(self, w: IntWeight, shared: dict | None = None):
        group_size, perm = _int4pack_layout(w)
        codes, groups = w.qweight, w.group_index()
        if perm is not None:  # act-order: columns sorted by group make the groups contiguous
            codes, groups = codes[:, perm], groups[perm]
        k = w.in_features
        padded_k = -(-k // group_size) * group_size
        self.perm = perm
        self.pad = padded_k - k
        codes = F.pad(codes, (0, self.pad), value=8)  # padding columns meet zero columns of x
        s = w.scales.float()  # (N, G)
        zero = (w.midpoint - w.zero_points().float()) * s  # (N, G): (q - z) s = (q - 8) s + (8 - z) s
        if w.offsets is not None:  # float minima (GGUF Q4_1) add to the same per-group term
            zero = zero + w.offsets.float()
        # Map every padded column to the scale/zero of its group (per-channel weights repeat their one group).
        col_group = F.pad(groups, (0, self.pad), value=int(groups[-1]) if k else 0)
        first_col = torch.arange(0, padded_k, group_size)
        scale_g = s[:, col_group[first_col]]  # (N, G')
        zero_g = zero[:, col_group[first_col]]
        self.group_size = group_size
        self.packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
        self.scale_zeros = torch.stack([scale_g.t(), zero_g.t()], dim=-1).contiguous()  # (G', N, 2)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(1, self.perm)
        if self.pad:
            x = F.pad(x, (0, self.pad))
        return torch._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, self.group_size, self.scale_zeros)

    def num_bytes(self) -> int:
        perm = 0 if self.perm is None else self.perm.numel() * 8
        return self.packed.numel() * self.packed.element_size() + self.scale_zeros.numel() * 4 + perm


def _int4pack_layout(w: IntWeight) -> tuple[int, torch.Tensor | None] | None:
    """(group size for the packed kernel, column permutation or None), or None when it cannot hold w."""
    k = w.in_features
    if w.num_groups == 1:
        # One scale per channel: any supported group size works, the scale is repeated; pick the
        # largest that wastes no padding, else the smallest (least padding).
        fits = [g for g in reversed(INT4PACK_GROUP_SIZES) if k % g == 0]
        return (fits[0] if fits else INT4PACK_GROUP_SIZES[0]), None
    if w.group_size not in INT4PACK_GROUP_SIZES:
        return None
    if not w.is_act_order:
        return w.group_size, None
    groups = w.group_index()
    perm = torch.argsort(groups, stable=True)
    # After sorting, column i must belong to group i // group_size (GPTQ's act-order guarantees it).
    expected = torch.arange(k) // w.group_size
    if not torch.equal(groups[perm], expected):
        return None
    return w.group_size, perm


class DequantKernel:
    supported_bits = (4, 8)
    name = "dequant"

    @staticmethod
    def can_run(w: IntWeight) -> bool:
        return True

    def __init__(self, w: IntWeight, shared: dict | None = None, tile_bytes: int = DEQUANT_TILE_BYTES):
        shared = {} if shared is None else shared
        self.bits = w.bits
        self.in_features = w.in_features
        self.scale = float_scales(w, shared)  # (N, G) float32
        if w.bits == 8:
            # Signed codes q - 128 (shared with the int8 kernel): w = (q - 128) s - (z - 128) s + m.
            self.codes = signed_codes(w, shared)  # (N, K) int8
            self.neg_zs = int8_neg_zs(w, shared)  # (N, G) or None
        else:  # two codes per byte: low nibble = even column
            codes = F.pad(w.qweight, (0, w.in_features % 2))
            self.codes = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()  # (N, ceil(K / 2)) uint8
            neg_zs = -w.zero_points().float() * self.scale
            if w.offsets is not None:
                neg_zs = neg_zs + w.offsets.float()
            self.neg_zs = neg_zs.contiguous()  # (N, G): -z * s + m
        # Each column's scale comes from repeat_interleave (groups in order) or index_select (act-order):
        # both write contiguous (rows, K) tables, which the fused multiply-add then streams; a broadcast
        # view with a stride-0 last dimension measured ~19x slower in torch's CPU elementwise loops.
        self.group_size = None if w.is_act_order else w.group_size
        self.groups = w.group_index() if w.is_act_order else None  # (K,)
        self.tile_rows = max(16, tile_bytes // (4 * max(1, w.in_features)))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = self.codes.shape[0]
        # Tiles of output rows of y^T (N, M) are contiguous, so each GEMM writes its block in place
        # (an out= slice of y (M, N) would be strided and make torch copy).
        out_t = torch.empty(n, x.shape[0], dtype=x.dtype, device=x.device)
        x_t = x.t()
        for lo in range(0, n, self.tile_rows):
            hi = min(n, lo + self.tile_rows)
            torch.mm(self.dequantize_rows(lo, hi), x_t, out=out_t[lo:hi])
        return out_t.t().contiguous()  # callers (the C elementwise kernels) want contiguous rows

    def dequantize_rows(self, lo: int, hi: int) -> torch.Tensor:
        """Rows [lo, hi) of the weight as float32 (hi - lo, K): q * s - z * s in one fused pass."""
        codes = self.codes[lo:hi]
        if self.bits == 4:
            codes = torch.stack([codes & 0xF, codes >> 4], dim=-1).reshape(hi - lo, -1)[:, :self.in_features]
        q = codes.float()
        k = self.in_features
        if self.group_size is not None:
            def per_column(t):
                return t[lo:hi].repeat_interleave(self.group_size, dim=1)[:, :k]  # (rows, K)
        else:
            def per_column(t):
                return t[lo:hi].index_select(1, self.groups)
        if self.neg_zs is None:
            return q.mul_(per_column(self.scale))
        return torch.addcmul(per_column(self.neg_zs), q, per_column(self.scale))

    def num_bytes(self) -> int:
        return self.codes.numel() + self.scale.numel() * 4 + (0 if self.neg_zs is None else self.neg_zs.numel() * 4)


CPU_KERNELS = {k.name: k for k in (Int8PackKernel, Int4PackKernel, DequantKernel)}
