"""Weight-only FP8 matmul: y = x @ (q * scale)^T with the E4M3 weight widened tile by tile in registers.

The torch w8a16 path materializes the whole widened weight in memory on every call; this kernel
reads the 1-byte weight once per output tile instead, so a decode step moves half the bytes of bf16.
The per-output-channel scale is applied once to the accumulator (it is constant along K). Tiles are
chosen by M (kernels/matmul_tiles.py, shared with the integer GEMM).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.kernels.matmul_tiles import check_tiles, tiles_for

FP8_DTYPE = torch.float8_e4m3fn


@triton.jit
def _fp8_w8a16_matmul_kernel(
    x_ptr, w_ptr, scale_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
    IS_PER_CHANNEL: tl.constexpr, IS_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :] * stride_xk,
                    mask=(offs_m[:, None] < M) & (k[None, :] < K), other=0.0)  # (BLOCK_M, BLOCK_K)
        # The weight tile is read transposed, (BLOCK_K, BLOCK_N); masked lanes must be 0, not garbage
        # that could decode as NaN and poison the dot product.
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + k[:, None] * stride_wk,
                    mask=(offs_n[None, :] < N) & (k[:, None] < K), other=0.0)
        if IS_FP32:
            acc += tl.dot(x, w.to(tl.float32), input_precision="ieee")  # no silent TF32 for float32 models
        else:
            acc += tl.dot(x, w.to(x.dtype))
    if IS_PER_CHANNEL:
        scale = tl.load(scale_ptr + offs_n, mask=offs_n < N, other=0.0)  # (BLOCK_N,)
        acc = acc * scale[None, :]
    else:
        acc = acc * tl.load(scale_ptr)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
             acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def fp8_w8a16_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                     tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x (M, K) float16/bfloat16/float32, weight (N, K) float8_e4m3fn, scale (N,) or (1,) float32 -> (M, N) in x's dtype."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"expected x (M, K) and weight (N, K); got {tuple(x.shape)} and {tuple(weight.shape)}")
    if weight.dtype != FP8_DTYPE:
        raise ValueError(f"weight must be float8_e4m3fn, got {weight.dtype}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    num_rows, num_cols = weight.shape
    if scale.dtype != torch.float32 or scale.numel() not in (1, num_rows) or not scale.is_contiguous():
        raise ValueError(f"scale must be a contiguous float32 tensor of 1 or {num_rows} values, "
                         f"got {scale.dtype} {tuple(scale.shape)}")
    if x.device != weight.device or x.device != scale.device:
        raise ValueError("x, weight and scale must be on the same device")
    m = x.shape[0]
    block_m, block_n, block_k = tiles = tiles or tiles_for(m)  # by M (kernels/matmul_tiles.py)
    check_tiles(tiles)
    out = torch.empty(m, num_rows, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(num_rows, block_n))
    _fp8_w8a16_matmul_kernel[grid](
        x, weight, scale, out, m, num_rows, num_cols,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        IS_PER_CHANNEL=scale.numel() == num_rows and num_rows > 1, IS_FP32=x.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return out
