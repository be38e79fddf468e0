"""What the Triton weight-only GEMMs (FP8 W8A16, integer W4A16/W8A16) share: the tile a program
computes, the activation tile it loads and the output tile it stores. Each kernel keeps only its own
weight decoding. Tiles and warps come from kernels/triton_tuning.py (by M, never by the batch's contents).

A 1-D grid walks the output tiles GROUP_M tile rows at a time (column by column within a group), so
programs that run together read the same weight tiles from L2 (prefill-sized M); a decode-sized M
has one tile row and the order is plain.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tile_offsets(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(offs_m (BLOCK_M,), offs_n (BLOCK_N,)): the output rows and columns of this program's tile."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    return pid_m * BLOCK_M + tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit
def load_x_tile(x_ptr, offs_m, k, M, K, stride_xm, stride_xk):
    """The activations' (BLOCK_M, BLOCK_K) tile at rows offs_m, columns k; 0 past M and K."""
    return tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :] * stride_xk,
                   mask=(offs_m[:, None] < M) & (k[None, :] < K), other=0.0)


@triton.jit
def dot_tile(acc, x, w, IS_FP32: tl.constexpr):
    """acc += x @ w with w widened to x's dtype; float32 models multiply in IEEE float32 (no TF32)."""
    if IS_FP32:
        return acc + tl.dot(x, w.to(tl.float32), input_precision="ieee")
    return acc + tl.dot(x, w.to(x.dtype))


@triton.jit
def store_tile(out_ptr, acc, offs_m, offs_n, M, N, stride_om, stride_on):
    """The float32 accumulator into the output's dtype at (offs_m, offs_n), inside (M, N) only."""
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
             acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def grid_size(num_rows: int, num_cols: int, block_m: int, block_n: int) -> tuple[int]:
    return (triton.cdiv(num_rows, block_m) * triton.cdiv(num_cols, block_n),)
