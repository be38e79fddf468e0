"""MXFP4 (OCP Microscaling Formats v1.0, as gpt-oss publishes its experts): dequantization.

A block is 32 FP4 values (E2M1: a sign, 2 exponent bits with bias 1, 1 mantissa bit; the codes 0..7 are
0, 0.5, 1, 1.5, 2, 3, 4, 6 and 8..15 their negatives) sharing one E8M0 scale (an 8-bit biased exponent:
2^(code - 127); 255 is NaN). Stored as gpt-oss's checkpoints hold it: `*_blocks` uint8 (..., G, 16), two
values a byte, the lower nibble first; `*_scales` uint8 (..., G). Row r of a (N, K) weight is
blocks[..., r, :, :] (K = 32 G input channels), so a dequantized tensor is (..., N, K).
"""

from __future__ import annotations

import torch

BLOCK_VALUES = 32
E8M0_BIAS = 127
E8M0_NAN = 255
# E2M1 code -> value (OCP MX v1.0, section 5.3.3)
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(..., G, 16) uint8 codes and (..., G) uint8 scales -> (..., 32 G) values in `dtype` (exact in
    float32 and bfloat16 for every finite scale they can hold; E8M0 255 gives NaN). ValueError naming
    the shapes or dtypes that do not fit the layout."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8; got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK_VALUES // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks must be (..., G, {BLOCK_VALUES // 2}) with scales (..., G); got "
                         f"{tuple(blocks.shape)} and {tuple(scales.shape)}")
    table = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    values = torch.stack((table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]), dim=-1)  # (..., G, 16, 2)
    values = values.flatten(-2)  # (..., G, 32): low nibble, then high nibble, byte by byte
    exponents = scales.to(torch.int32) - E8M0_BIAS
    out = torch.ldexp(values, exponents.unsqueeze(-1).to(torch.float32))
    out = torch.where((scales == E8M0_NAN).unsqueeze(-1), torch.full_like(out, float("nan")), out)
    return out.flatten(-2).to(dtype)
