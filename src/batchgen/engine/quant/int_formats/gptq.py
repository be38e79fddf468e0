"""GPTQ checkpoints (AutoGPTQ / GPTQModel / Optimum "gptq" layout) -> IntWeight.

Per linear layer `prefix.`:
- qweight (K * bits / 32, N) int32: packed along the input dim, word r holds input rows
  r * (32 // bits) + i in bits [i * bits, (i + 1) * bits);
- qzeros (G, N * bits / 32) int32: packed along the output dim the same way;
- scales (G, N) float16; g_idx (K,) int32 (act-order: the group of each input column);
- bias (N,) optional.
w = (q - z) * s. The original format ("gptq", checkpoint_format v1) stores z - 1 in qzeros, so its
zeros read back as stored + 1; GPTQModel's "gptq_v2" stores z itself.
"""

from __future__ import annotations

import torch

from batchgen.engine.quant.int_formats.int_weight import IntWeight, resolve_group_size, unpack_int32

CHECKPOINT_FORMATS = ("gptq", "gptq_v2")


def read_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, *, bits: int,
              group_size: int, g_idx: torch.Tensor | None = None,
              checkpoint_format: str = "gptq") -> IntWeight:
    """One GPTQ layer's tensors -> IntWeight; group_size -1 means one group per output channel."""
    if bits not in (4, 8):
        raise ValueError(f"GPTQ bits must be 4 or 8, got {bits}")
    if checkpoint_format not in CHECKPOINT_FORMATS:
        raise ValueError(f"GPTQ checkpoint_format must be one of {', '.join(CHECKPOINT_FORMATS)}, got {checkpoint_format!r}")
    per_word = 32 // bits
    num_groups, out_features = scales.shape
    if qweight.shape[1] != out_features or qzeros.shape != (num_groups, out_features // per_word):
        raise ValueError(f"GPTQ tensors disagree: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
                         f"scales {tuple(scales.shape)} for {bits} bits")
    codes = unpack_int32(qweight, bits, dim=0)  # (K, N)
    in_features = codes.shape[0]
    if g_idx is not None and g_idx.numel() != in_features:
        raise ValueError(f"g_idx has {g_idx.numel()} entries for {in_features} input features")
    zeros = unpack_int32(qzeros, bits, dim=1).to(torch.int16)  # (G, N)
    if checkpoint_format == "gptq":
        zeros = zeros + 1  # the v1 "minus one" convention
    return IntWeight(qweight=codes.t().contiguous(), scales=scales.t().contiguous(), zeros=zeros.t().contiguous(),
                     group_size=resolve_group_size(in_features, group_size), bits=bits,
                     g_idx=None if g_idx is None else g_idx.to(torch.int32))
