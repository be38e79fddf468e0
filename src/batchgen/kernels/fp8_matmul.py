"""Weight-only FP8 matmul: y = x @ (q * scale)^T with the E4M3 weight widened tile by tile in registers.

The torch w8a16 path materializes the whole widened weight in memory on every call; this kernel
reads the 1-byte weight once per output tile instead, so a decode step moves half the bytes of bf16.
The per-output-channel scale is applied once to the accumulator (it is constant along K). The tile
walk, the activation loads and the store are shared with the integer GEMM (kernels/matmul_tiles.py);
tiles by M and K, BLOCK_K >= 64 where K allows (kernels/triton_tuning.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.kernels.matmul_tiles import dot_tile, grid_size, load_x_tile, store_tile, tile_offsets
from batchgen.kernels.triton_tuning import GemmTiles, choose, gemm_candidates

FP8_DTYPE = torch.float8_e4m3fn


@triton.jit
def _fp8_w8a16_matmul_kernel(
    x_ptr, w_ptr, scale_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
    IS_PER_CHANNEL: tl.constexpr, IS_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    offs_m, offs_n = tile_offsets(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        x = load_x_tile(x_ptr, offs_m, k, M, K, stride_xm, stride_xk)  # (BLOCK_M, BLOCK_K)
        # The weight tile is read transposed, (BLOCK_K, BLOCK_N); masked lanes must be 0, not garbage
        # that could decode as NaN and poison the dot product.
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + k[:, None] * stride_wk,
                    mask=(offs_n[None, :] < N) & (k[:, None] < K), other=0.0)
        acc = dot_tile(acc, x, w, IS_FP32)
    if IS_PER_CHANNEL:
        scale = tl.load(scale_ptr + offs_n, mask=offs_n < N, other=0.0)  # (BLOCK_N,)
        acc = acc * scale[None, :]
    else:
        acc = acc * tl.load(scale_ptr)
    store_tile(out_ptr, acc, offs_m, offs_n, M, N, stride_om, stride_on)


def fp8_w8a16_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                     tiles: GemmTiles | None = None) -> torch.Tensor:
    """x (M, K) float16/bfloat16/float32, weight (N, K) float8_e4m3fn, scale (N,) or (1,) float32 -> (M, N)
    in x's dtype. `tiles`: kernels/triton_tuning.py's choice for this M and K when None."""
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
    out = torch.empty(m, num_rows, dtype=x.dtype, device=x.device)

    def launch(t: GemmTiles) -> None:
        _fp8_w8a16_matmul_kernel[grid_size(m, num_rows, t.block_m, t.block_n)](
            x, weight, scale, out, m, num_rows, num_cols,
            x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
            IS_PER_CHANNEL=scale.numel() == num_rows and num_rows > 1, IS_FP32=x.dtype == torch.float32,
            BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m,
            num_warps=t.num_warps, num_stages=t.num_stages,
        )

    if tiles is None:
        candidates = gemm_candidates(m, num_cols, "fp8", x.dtype)
        tiles = choose(("fp8_w8a16", candidates[0].block_m, num_rows, num_cols, x.dtype), candidates, launch,
                       is_capturing=x.is_cuda and torch.cuda.is_current_stream_capturing())
    launch(tiles)
    return out
