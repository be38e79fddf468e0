"""FP8 weights with block scales (DeepSeek-V3 and the Qwen3 FP8 checkpoints: `weight_block_size` [128, 128]):
dequantization.

The checkpoint holds `weight` float8_e4m3fn (..., N, K) and `weight_scale_inv` float32 (..., ceil(N / bn),
ceil(K / bk)): the value of element (n, k) is weight[n, k] x weight_scale_inv[n // bn, k // bk] (the name
says "inverse": the quantizer divided by it). Edge blocks may be partial.
"""

from __future__ import annotations

import torch


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int],
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(..., N, K) float8 weights and their (..., ceil(N / bn), ceil(K / bk)) scales -> (..., N, K) in
    `dtype` (the product formed in float32). ValueError naming the shapes that do not fit the blocks."""
    block_rows, block_cols = block_size
    rows, cols = weight.shape[-2:]
    expected = (*weight.shape[:-2], -(-rows // block_rows), -(-cols // block_cols))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"an FP8 weight of shape {tuple(weight.shape)} in blocks of {block_rows} x {block_cols} "
                         f"needs scales of shape {expected}; got {tuple(scale_inv.shape)}")
    scale = scale_inv.to(torch.float32).repeat_interleave(block_rows, dim=-2).repeat_interleave(block_cols, dim=-1)
    return (weight.to(torch.float32) * scale[..., :rows, :cols]).to(dtype)
