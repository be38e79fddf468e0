"""AWQ checkpoints (AutoAWQ's GEMM version) -> IntWeight.

Per linear layer `prefix.`:
- qweight (K, N / 8) int32: packed along the output dim, 8 nibbles per word, interleaved: nibble i
  of word c holds output column c * 8 + [0, 2, 4, 6, 1, 3, 5, 7][i];
- qzeros (G, N / 8) int32: the same packing; zero points are stored as they are (no "minus one");
- scales (G, N) float16; w = (q - z) * s with group g(k) = k // group_size.
"""

from __future__ import annotations

import torch

from batchgen.engine.quant.int_formats.int_weight import IntWeight, resolve_group_size, unpack_int32

# Column j of a word sits in nibble AWQ_COLUMN_SLOT[j] (the inverse of the packing order above).
AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
AWQ_COLUMN_SLOT = [AWQ_PACK_ORDER.index(j) for j in range(8)]  # [0, 4, 1, 5, 2, 6, 3, 7]
VERSIONS = ("gemm",)


def read_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, *, group_size: int,
             bits: int = 4) -> IntWeight:
    """One AWQ GEMM layer's tensors -> IntWeight."""
    if bits != 4:
        raise ValueError(f"AWQ checkpoints are 4-bit, got {bits}")
    num_groups, out_features = scales.shape
    if qweight.shape[1] * 8 != out_features or qzeros.shape != (num_groups, out_features // 8):
        raise ValueError(f"AWQ tensors disagree: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
                         f"scales {tuple(scales.shape)}")
    codes = unpack_int32(qweight, 4, dim=1, order=AWQ_COLUMN_SLOT)  # (K, N)
    zeros = unpack_int32(qzeros, 4, dim=1, order=AWQ_COLUMN_SLOT)  # (G, N)
    in_features = codes.shape[0]
    return IntWeight(qweight=codes.t().contiguous(), scales=scales.t().contiguous(),
                     zeros=zeros.t().contiguous().to(torch.int16),
                     group_size=resolve_group_size(in_features, group_size), bits=4)
