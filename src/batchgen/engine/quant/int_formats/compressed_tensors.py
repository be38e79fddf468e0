"""compressed-tensors checkpoints (llm-compressor's W4A16 / W8A16) -> IntWeight.

Two formats, per linear layer `prefix.`:
- "pack-quantized": weight_packed (N, ceil(K / (32 // bits))) int32, packed along the input dim:
  word w holds columns w * (32 // bits) + i at bits [i * bits, (i + 1) * bits), each stored as the
  signed value + 2**(bits-1) (the last word zero-padded); weight_shape (2,) = (N, K).
  Asymmetric group/channel weights add weight_zero_point packed the same way along the OUTPUT dim:
  (ceil(N / (32 // bits)), G) int32. Older writers stored it unpacked, (N, G) integers; both are read.
- "int-quantized": weight (N, K) int8 signed values, unpacked; weight_zero_point (N, G) if any.
Both: weight_scale (N, G) for strategy "group", (N, 1) for "channel", one value for "tensor";
weight_g_idx (K,) for act-order groups. w = (q - zp) * scale with q and zp signed.
"""

from __future__ import annotations

import torch

from batchgen.engine.quant.int_formats.int_weight import IntWeight, unpack_int32

FORMATS = ("pack-quantized", "int-quantized")
STRATEGIES = ("group", "channel", "tensor")


def read_pack_quantized(weight_packed: torch.Tensor, weight_scale: torch.Tensor, weight_shape: torch.Tensor | tuple,
                        *, bits: int, weight_zero_point: torch.Tensor | None = None,
                        weight_g_idx: torch.Tensor | None = None, group_size: int | None = None) -> IntWeight:
    """One pack-quantized layer -> IntWeight (codes = the unpacked unsigned values, signed + 2**(bits-1))."""
    out_features, in_features = (int(v) for v in weight_shape)
    if weight_packed.shape[0] != out_features or weight_packed.shape[1] * (32 // bits) < in_features:
        raise ValueError(f"weight_packed {tuple(weight_packed.shape)} cannot hold a ({out_features}, {in_features}) "
                         f"{bits}-bit weight")
    codes = unpack_int32(weight_packed, bits, dim=1)[:, :in_features]  # (N, K), drop the padding
    scales = _scales(weight_scale, out_features)
    zeros = None
    if weight_zero_point is not None:
        is_packed = weight_zero_point.dtype == torch.int32 and weight_zero_point.shape[0] != out_features
        if is_packed:
            zero_codes = unpack_int32(weight_zero_point, bits, dim=0)[:out_features]  # (N, G) unsigned
        else:
            zero_codes = weight_zero_point.to(torch.int16) + (1 << (bits - 1))
        zeros = _broadcast_rows(zero_codes.to(torch.int16), out_features)
    return _make(codes.contiguous(), scales, zeros, bits, weight_g_idx, group_size)


def read_int_quantized(weight: torch.Tensor, weight_scale: torch.Tensor, *, bits: int = 8,
                       weight_zero_point: torch.Tensor | None = None, weight_g_idx: torch.Tensor | None = None,
                       group_size: int | None = None) -> IntWeight:
    """One int-quantized layer (signed int8 values, one per byte) -> IntWeight."""
    if weight.dtype != torch.int8 or weight.dim() != 2:
        raise ValueError(f"int-quantized weight must be (N, K) int8, got {weight.dtype} {tuple(weight.shape)}")
    offset = 1 << (bits - 1)
    out_features = weight.shape[0]
    codes = (weight.to(torch.int16) + offset).to(torch.uint8)  # (N, K)
    zeros = None
    if weight_zero_point is not None:
        zeros = _broadcast_rows(weight_zero_point.to(torch.int16) + offset, out_features)
    return _make(codes, _scales(weight_scale, out_features), zeros, bits, weight_g_idx, group_size)


def _make(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
          g_idx: torch.Tensor | None, group_size: int | None) -> IntWeight:
    in_features, num_groups = codes.shape[1], scales.shape[1]
    if zeros is not None and zeros.shape[1] == 1 and num_groups > 1:
        zeros = zeros.expand(-1, num_groups)
    if group_size is None or group_size <= 0:
        # channel / tensor strategies (one group), or a group layout the config did not spell out.
        group_size = -(-in_features // num_groups)
    return IntWeight(qweight=codes, scales=scales, zeros=None if zeros is None else zeros.contiguous(),
                     group_size=group_size, bits=bits, g_idx=g_idx)


def _scales(weight_scale: torch.Tensor, out_features: int) -> torch.Tensor:
    """(N, G) scales from a group (N, G), channel (N, 1) or tensor (1,) / (1, 1) weight_scale."""
    scale = weight_scale.reshape(1, 1) if weight_scale.numel() == 1 else weight_scale
    if scale.dim() == 1:
        scale = scale.reshape(-1, 1)
    return _broadcast_rows(scale, out_features).contiguous()


def _broadcast_rows(t: torch.Tensor, out_features: int) -> torch.Tensor:
    if t.dim() == 1:
        t = t.reshape(-1, 1) if t.numel() == out_features else t.reshape(1, -1)
    if t.shape[0] == 1 and out_features != 1:
        t = t.expand(out_features, -1)
    if t.shape[0] != out_features:
        raise ValueError(f"expected {out_features} rows of scales or zero points, got {tuple(t.shape)}")
    return t
