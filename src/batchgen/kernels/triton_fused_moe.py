"""The fused MoE on CUDA: one grouped GEMM launch per projection over expert-sorted token blocks (the
scheme of vLLM's fused_moe, written here from its description).

1. `align_by_expert` (torch ops on the device, no host sync): the (T*k) routed rows sorted by expert,
   each expert's run padded to a multiple of BLOCK_M with a sentinel row (T*k), and one expert id per
   block of BLOCK_M rows (-1 past the last used block). The grid is sized by the worst case,
   T*k + E*(BLOCK_M - 1) rows, so it does not depend on the routing (CUDA-graph friendly).
2. `_grouped_gemm_kernel`: a program computes one (BLOCK_M rows x BLOCK_N columns) tile of one block:
   its rows' activations (row // ROWS_PER_A: token rows for the first projection, routed rows for the
   second) times its expert's weight, optionally scaled by each row's router weight, stored at the
   routed rows' places. Padding rows load nothing and store nothing.
3. gate_up projection (one launch), SiLU(gate) * up (torch), down projection with the router weights
   (one launch), the k rows of each token summed (torch). Experts with biases (gpt-oss) add each row's
   expert's bias after the first launch and its weighted bias after the second (torch gathers), with the
   activation the caller passes (gpt-oss's clamped SwiGLU).

Shapes as kernels/fused_moe.py: x (T, H), gate_up (E, 2I, H), down (E, H, I), weights / ids (T, k).
Tiles: kernels/triton_tuning.py's moe_candidates. Checked under TRITON_INTERPRET=1 against
fused_moe.fused_moe_per_expert_ref (tests/kernels/test_triton_fused_moe.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.kernels.fused_moe import silu_mul_rows, sort_by_expert
from batchgen.kernels.matmul_tiles import dot_tile
from batchgen.kernels.triton_tuning import GemmTiles, choose, moe_candidates


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids (T, k) -> (rows (P,) int32: routed row indices (token * k + slot) grouped by expert, each expert's
    run padded to a multiple of block_m with T*k; block_experts (P / block_m,) int32: each block's expert,
    -1 for the unused blocks at the end). P = T*k + E*(block_m - 1) rounded up to block_m, whatever the
    routing."""
    num_rows = ids.numel()
    order, counts = sort_by_expert(ids, num_experts)
    padded = (counts + block_m - 1) // block_m * block_m  # (E,)
    padded_ends = padded.cumsum(0)
    padded_starts = padded_ends - padded
    starts = counts.cumsum(0) - counts
    expert_of_sorted = ids.reshape(-1)[order]  # (T*k,) non-decreasing
    position = torch.arange(num_rows, device=ids.device)
    dest = padded_starts[expert_of_sorted] + (position - starts[expert_of_sorted])
    capacity = triton.cdiv(num_rows + num_experts * (block_m - 1), block_m) * block_m
    rows = torch.full((capacity,), num_rows, dtype=torch.int32, device=ids.device)
    rows[dest] = order.to(torch.int32)
    block_start = torch.arange(0, capacity, block_m, device=ids.device)
    block_experts = torch.searchsorted(padded_ends, block_start, right=True).to(torch.int32)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1).to(torch.int32)
    return rows, block_experts


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, w_ptr, out_ptr, rows_ptr, block_experts_ptr, weights_ptr, scale_ptr,
    num_rows, N, K, ROWS_PER_A,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_om, stride_on, stride_se,
    MUL_ROUTER_WEIGHT: tl.constexpr, IS_FP32: tl.constexpr, W_FP8: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    block = pid // num_n
    pid_n = pid % num_n
    expert = tl.load(block_experts_ptr + block)
    if expert < 0:  # past the last used block
        return
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(rows_ptr + offs_m)  # (BLOCK_M,) routed rows; num_rows = padding
    is_row = rows < num_rows
    a_rows = rows // ROWS_PER_A
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + k[None, :] * stride_ak,
                    mask=is_row[:, None] & (k[None, :] < K), other=0.0)  # (BLOCK_M, BLOCK_K)
        w = tl.load(w_base + offs_n[None, :] * stride_wn + k[:, None] * stride_wk,
                    mask=(offs_n[None, :] < N) & (k[:, None] < K), other=0.0)  # (BLOCK_K, BLOCK_N)
        if W_FP8:  # E4M3 codes widened to the activations' dtype; the scales come after the K loop
            w = w.to(a.dtype)
        acc = dot_tile(acc, a, w, IS_FP32)
    if W_FP8:  # one scale per (expert, output channel): it factors out of the K sum
        acc = acc * tl.load(scale_ptr + expert.to(tl.int64) * stride_se + offs_n, mask=offs_n < N, other=0.0)[None, :]
    if MUL_ROUTER_WEIGHT:
        acc = acc * tl.load(weights_ptr + rows, mask=is_row, other=0.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on,
             acc.to(out_ptr.dtype.element_ty), mask=is_row[:, None] & (offs_n[None, :] < N))


def grouped_gemm(a: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor, block_experts: torch.Tensor,
                 num_rows: int, rows_per_a: int, tiles: GemmTiles, router_weights: torch.Tensor | None = None,
                 scale: torch.Tensor | None = None) -> torch.Tensor:
    """out (num_rows, N): out[r] = a[r // rows_per_a] @ weight[expert of r]^T (x router_weights[r]).
    `scale` (E, N) float32: weight holds E4M3 codes, expert e's row n is codes[e, n] * scale[e, n]."""
    num_experts, n, k = weight.shape
    out = torch.empty(num_rows, n, dtype=a.dtype, device=a.device)
    grid = (block_experts.numel() * triton.cdiv(n, tiles.block_n),)
    _grouped_gemm_kernel[grid](
        a, weight, out, rows, block_experts, router_weights if router_weights is not None else out,
        scale if scale is not None else out,  # never dereferenced without W_FP8
        num_rows, n, k, rows_per_a,
        a.stride(0), a.stride(1), weight.stride(0), weight.stride(1), weight.stride(2), out.stride(0), out.stride(1),
        scale.stride(0) if scale is not None else 0,
        MUL_ROUTER_WEIGHT=router_weights is not None, IS_FP32=a.dtype == torch.float32, W_FP8=scale is not None,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out


def fused_moe_triton(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                     ids: torch.Tensor, tiles: GemmTiles | None = None, activation=silu_mul_rows,
                     gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                     gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None) -> torch.Tensor:
    """(T, H) -> (T, H): each token's k experts' SwiGLU MLPs weighted and summed (fused_moe.py's contract,
    `activation` and the optional (E, 2I) / (E, H) biases as fused_moe_torch's). `tiles`: the tuning
    table's choice for this shape when None (one configuration for both launches). FP8 experts
    (engine/quant/fp8_experts.py): gate_up and down hold E4M3 codes, `gate_up_scale` (E, 2I) and
    `down_scale` (E, H) float32 their per-(expert, output channel) scales."""
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if gate_up.dim() != 3 or gate_up.shape[2] != x.shape[1] or down.shape[:2] != (gate_up.shape[0], x.shape[1]):
        raise ValueError(f"expected gate_up (E, 2I, H) and down (E, H, I) for H={x.shape[1]}; "
                         f"got {tuple(gate_up.shape)} and {tuple(down.shape)}")
    num_tokens, top_k = ids.shape
    num_experts, hidden = gate_up.shape[0], x.shape[1]
    num_rows = num_tokens * top_k
    flat_weights = weights.reshape(-1).float().contiguous()
    flat_ids = ids.reshape(-1)

    def run(t: GemmTiles) -> torch.Tensor:
        rows, block_experts = align_by_expert(ids, num_experts, t.block_m)
        projected = grouped_gemm(x, gate_up, rows, block_experts, num_rows, top_k, t, scale=gate_up_scale)  # (T*k, 2I)
        if gate_up_bias is not None:
            projected += gate_up_bias[flat_ids]
        act = activation(projected)  # (T*k, I)
        out_rows = grouped_gemm(act, down, rows, block_experts, num_rows, 1, t, flat_weights, down_scale)  # (T*k, H)
        if down_bias is not None:  # the kernel weighted the product; the bias gets the same weight
            out_rows += (flat_weights[:, None] * down_bias[flat_ids].float()).to(out_rows.dtype)
        return out_rows.view(num_tokens, top_k, hidden).sum(dim=1)

    if tiles is None:
        candidates = moe_candidates(num_rows // max(1, min(num_experts, num_rows)), hidden, x.dtype)
        tiles = choose(("fused_moe", candidates[0].block_m, num_experts, hidden, gate_up.shape[1], x.dtype),
                       candidates, run, is_capturing=x.is_cuda and torch.cuda.is_current_stream_capturing())
    return run(tiles)
