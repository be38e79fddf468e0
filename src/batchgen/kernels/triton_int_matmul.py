"""Weight-only integer GEMM for CUDA (W4A16 / W8A16): y = x @ ((q - z) * s)^T, codes widened in registers.

Weight layout (prepared once by the engine, see pack_codes):
- codes: (N, K) uint8 for 8 bits; (N, ceil(K / 2)) uint8 for 4 bits, column 2j in the low nibble of
  byte j and column 2j + 1 in the high nibble;
- scales, zeros: (N, G) float32, float16 or bfloat16 (zeros in code units; None for symmetric weights,
  whose zero is 2**(bits-1)): 16-bit tables halve the side bytes, and the kernel widens them to float32;
- g_idx: (K,) int32 group of each input column for act-order weights, else groups are k // group_size.
Every K tile reads its codes once, looks up each column's scale and zero, and accumulates in float32;
K, N and M need not be multiples of anything (masked). The tile walk, activation loads and store are
shared with the FP8 GEMM (kernels/matmul_tiles.py); tiles by M (kernels/triton_tuning.py):
decode-sized M a short M tile and a long N tile, prefill-sized M square ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.kernels.matmul_tiles import dot_tile, grid_size, load_x_tile, store_tile, tile_offsets
from batchgen.kernels.triton_tuning import GemmTiles, choose, gemm_candidates


@triton.jit
def _int_matmul_kernel(
    x_ptr, codes_ptr, scales_ptr, zeros_ptr, g_idx_ptr, out_ptr,
    M, N, K, G, GROUP_SIZE,
    stride_xm, stride_xk, stride_cn, stride_om, stride_on,
    BITS: tl.constexpr, HAS_G_IDX: tl.constexpr, HAS_ZEROS: tl.constexpr, IS_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    offs_m, offs_n = tile_offsets(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_k = tl.arange(0, BLOCK_K)
    is_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k  # (BLOCK_K,)
        is_k = k < K
        x = load_x_tile(x_ptr, offs_m, k, M, K, stride_xm, stride_xk)  # (BLOCK_M, BLOCK_K)
        mask_kn = is_k[:, None] & is_n[None, :]
        if BITS == 4:
            byte = tl.load(codes_ptr + offs_n[None, :] * stride_cn + (k // 2)[:, None], mask=mask_kn, other=0)
            q = (byte.to(tl.int32) >> ((k % 2) * 4)[:, None]) & 0xF  # (BLOCK_K, BLOCK_N)
        else:
            q = tl.load(codes_ptr + offs_n[None, :] * stride_cn + k[:, None], mask=mask_kn, other=0).to(tl.int32)
        if HAS_G_IDX:
            g = tl.load(g_idx_ptr + k, mask=is_k, other=0)
        else:
            g = k // GROUP_SIZE
        sz_offs = offs_n[None, :] * G + g[:, None]  # (BLOCK_K, BLOCK_N) into the (N, G) tables
        s = tl.load(scales_ptr + sz_offs, mask=mask_kn, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            z = tl.load(zeros_ptr + sz_offs, mask=mask_kn, other=0.0).to(tl.float32)
        else:
            z = (1 << (BITS - 1)) * 1.0
        w = (q.to(tl.float32) - z) * s  # masked lanes: scale 0, so w = 0, never garbage
        acc = dot_tile(acc, x, w, IS_FP32)
    store_tile(out_ptr, acc, offs_m, offs_n, M, N, stride_om, stride_on)


SIDE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # scales and zeros tables


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(N, K) uint8 codes -> the kernel's layout: as is for 8 bits, two per byte (low nibble first) for 4."""
    if bits == 8:
        return codes.contiguous()
    codes = torch.nn.functional.pad(codes, (0, codes.shape[1] % 2))
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def int_weight_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                      bits: int, group_size: int, g_idx: torch.Tensor | None = None,
                      tiles: GemmTiles | None = None) -> torch.Tensor:
    """x (M, K) float16/bfloat16/float32, codes from pack_codes, scales/zeros (N, G) float32/16/bf16
    (zeros None: symmetric) -> (M, N) in x's dtype."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be (M, K) float16, bfloat16 or float32, got {x.dtype} {tuple(x.shape)}")
    num_rows, in_features = x.shape
    n = codes.shape[0]
    if codes.dtype != torch.uint8 or codes.shape[1] != (-(-in_features // 2) if bits == 4 else in_features):
        raise ValueError(f"codes {codes.dtype} {tuple(codes.shape)} do not hold {bits}-bit (N, K={in_features})")
    num_groups = scales.shape[1]
    for name, t in (("scales", scales), ("zeros", zeros)):
        if t is not None and (t.dtype not in SIDE_DTYPES or t.shape != (n, num_groups) or not t.is_contiguous()):
            raise ValueError(f"{name} must be contiguous float32, float16 or bfloat16 (N={n}, G), "
                             f"got {t.dtype} {tuple(t.shape)}")
    if g_idx is not None and (g_idx.dtype != torch.int32 or g_idx.shape != (in_features,)):
        raise ValueError(f"g_idx must be int32 (K={in_features},), got {g_idx.dtype} {tuple(g_idx.shape)}")
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)

    def launch(t: GemmTiles) -> None:
        _int_matmul_kernel[grid_size(num_rows, n, t.block_m, t.block_n)](
            x, codes, scales, scales if zeros is None else zeros, scales if g_idx is None else g_idx, out,
            num_rows, n, in_features, num_groups, group_size,
            x.stride(0), x.stride(1), codes.stride(0), out.stride(0), out.stride(1),
            BITS=bits, HAS_G_IDX=g_idx is not None, HAS_ZEROS=zeros is not None, IS_FP32=x.dtype == torch.float32,
            BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m,
            num_warps=t.num_warps, num_stages=t.num_stages,
        )

    if tiles is None:
        kind = f"int{bits}"
        candidates = gemm_candidates(num_rows, in_features, kind, x.dtype)
        tiles = choose((kind, candidates[0].block_m, n, in_features, x.dtype), candidates, launch,
                       is_capturing=x.is_cuda and torch.cuda.is_current_stream_capturing())
    launch(tiles)
    return out
