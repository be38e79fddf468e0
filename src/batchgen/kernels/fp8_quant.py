"""Dynamic per-token FP8 activation quantization in one launch (the W8A8 path on CUDA).

x (M, K) -> q (M, K) float8_e4m3fn and scale (M, 1) float32 with scale = max(amax(|x_row|) / 448,
1e-12) and q = clamp(x / scale, -448, 448): the same arithmetic as engine/quant/fp8_tensor.py's torch
version, which takes eight kernels (float, abs, amax, div, clamp, div, clamp, cast) and writes three
full-size temporaries. One program per row reads the row twice (the maximum, then the codes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
MIN_SCALE = 1e-12  # an all-zero row still gets a usable scale
MAX_BLOCK_K = 2048


@triton.jit
def _per_token_fp8_kernel(x_ptr, q_ptr, scale_ptr, K, stride_xm, stride_qm,
                          FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row, q_row = x_ptr + row * stride_xm, q_ptr + row * stride_qm
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX, MIN_SCALE)
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX)  # no infinity in e4m3fn: clamp first
        tl.store(q_row + offs, q.to(q_ptr.dtype.element_ty), mask=offs < K)


def quantize_fp8_per_token_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) float16/bfloat16/float32, rows contiguous -> (q (M, K) float8_e4m3fn, scale (M, 1) float32)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be (M, K) with contiguous rows, got {tuple(x.shape)} strides {x.stride()}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    num_rows, num_cols = x.shape
    q = torch.empty(num_rows, num_cols, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(num_rows, 1, dtype=torch.float32, device=x.device)
    if num_rows:
        block_k = min(MAX_BLOCK_K, triton.next_power_of_2(max(num_cols, 16)))
        _per_token_fp8_kernel[(num_rows,)](x, q, scale, num_cols, x.stride(0), q.stride(0),
                                           FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, BLOCK_K=block_k)
    return q, scale
