"""LoRA on CUDA: SGMV-style shrink and expand over a step's adapter segments (punica's split), one
launch each for every adapter of the step.

A step's tokens that run an adapter are listed in `token_order`, grouped by adapter slot: segment s
is `token_order[seg_starts[s]:seg_starts[s + 1]]` and runs slot `seg_slots[s]`, whose rank is
`slot_ranks[slot]` (0: the adapter does not target this module, nothing is added). Base tokens are in
no segment and are left as the base layer wrote them.

- shrink: `shrunk[i] = x[token_order[i]] @ A[slot][:, :rank]`, (T', R_max) float32 (columns past the
  rank stay 0);
- expand: `out[token_order[i]] += shrunk[i, :rank] @ B[slot][:rank]`, in place (the adapter's scale is
  folded into B when it is installed).

Products are accumulated in float32 with IEEE float32 inputs (no TF32), so the result matches the torch
reference to float32 rounding for every activation dtype. Tiles (kernels/triton_tuning.py
lora_candidates): BLOCK_T tokens of one segment by BLOCK_R rank columns (shrink) or BLOCK_N output
columns (expand); an empty segment launches programs that return at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.kernels.triton_tuning import LoRATiles, choose, lora_candidates


@triton.jit
def _sgmv_shrink_kernel(
    x_ptr, a_ptr, out_ptr, order_ptr, seg_starts_ptr, seg_slots_ptr, ranks_ptr,
    in_features, stride_x, stride_a_slot, stride_a_k, stride_out,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    seg = tl.program_id(0)
    t_start = tl.load(seg_starts_ptr + seg) + tl.program_id(1) * BLOCK_T
    end = tl.load(seg_starts_ptr + seg + 1)
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    rank = tl.load(ranks_ptr + slot)
    r_start = tl.program_id(2) * BLOCK_R
    if (t_start < end) & (r_start < rank):
        ts = t_start + tl.arange(0, BLOCK_T)
        t_mask = ts < end
        rows = tl.load(order_ptr + ts, mask=t_mask, other=0).to(tl.int64)
        rs = r_start + tl.arange(0, BLOCK_R)
        r_mask = rs < rank
        acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
        for k_start in range(0, in_features, BLOCK_K):
            ks = k_start + tl.arange(0, BLOCK_K)
            k_mask = ks < in_features
            x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=t_mask[:, None] & k_mask[None, :],
                        other=0.0)
            a = tl.load(a_ptr + slot * stride_a_slot + ks[:, None] * stride_a_k + rs[None, :],
                        mask=k_mask[:, None] & r_mask[None, :], other=0.0)
            acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
        tl.store(out_ptr + ts[:, None].to(tl.int64) * stride_out + rs[None, :], acc,
                 mask=t_mask[:, None] & r_mask[None, :])


@triton.jit
def _sgmv_expand_kernel(
    s_ptr, b_ptr, out_ptr, order_ptr, seg_starts_ptr, seg_slots_ptr, ranks_ptr,
    out_features, stride_s, stride_b_slot, stride_b_r, stride_out,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    seg = tl.program_id(0)
    t_start = tl.load(seg_starts_ptr + seg) + tl.program_id(1) * BLOCK_T
    end = tl.load(seg_starts_ptr + seg + 1)
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    rank = tl.load(ranks_ptr + slot)
    if (t_start < end) & (rank > 0):
        ts = t_start + tl.arange(0, BLOCK_T)
        t_mask = ts < end
        rows = tl.load(order_ptr + ts, mask=t_mask, other=0).to(tl.int64)
        ns = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = ns < out_features
        acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
        for r_start in range(0, rank, BLOCK_R):
            rs = r_start + tl.arange(0, BLOCK_R)
            r_mask = rs < rank
            s = tl.load(s_ptr + ts[:, None].to(tl.int64) * stride_s + rs[None, :],
                        mask=t_mask[:, None] & r_mask[None, :], other=0.0)
            b = tl.load(b_ptr + slot * stride_b_slot + rs[:, None] * stride_b_r + ns[None, :],
                        mask=r_mask[:, None] & n_mask[None, :], other=0.0)
            acc += tl.dot(s.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        mask = t_mask[:, None] & n_mask[None, :]
        pointers = out_ptr + rows[:, None] * stride_out + ns[None, :]
        current = tl.load(pointers, mask=mask, other=0.0)
        tl.store(pointers, (current.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weights: torch.Tensor, what: str) -> None:
    if x.stride(-1) != 1 or weights.stride(-1) != 1:
        raise ValueError(f"sgmv_{what}: the activations' and the weights' last dimension must be contiguous")


def sgmv_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_order: torch.Tensor, seg_starts: torch.Tensor,
                seg_slots: torch.Tensor, slot_ranks: torch.Tensor, max_segment_len: int,
                tiles: LoRATiles | None = None) -> torch.Tensor:
    """`x` (T, in), `lora_a` (S, in, R_max): (T', R_max) float32, row i = x[token_order[i]] @ A[slot]
    over the slot's rank (the columns past it 0). `max_segment_len`: the longest segment (the grid).
    `tiles`: the configuration (default: the tuning table's choice)."""
    _check(x, lora_a, "shrink")
    out = torch.zeros(token_order.numel(), lora_a.shape[2], dtype=torch.float32, device=x.device)
    if seg_slots.numel() == 0 or max_segment_len == 0:
        return out

    def launch(t: LoRATiles) -> None:
        grid = (seg_slots.numel(), triton.cdiv(max_segment_len, t.block_t), triton.cdiv(lora_a.shape[2], t.block_out))
        _sgmv_shrink_kernel[grid](
            x, lora_a, out, token_order, seg_starts, seg_slots, slot_ranks,
            x.shape[1], x.stride(0), lora_a.stride(0), lora_a.stride(1), out.stride(0),
            BLOCK_T=t.block_t, BLOCK_K=t.block_red, BLOCK_R=t.block_out, num_warps=t.num_warps,
            num_stages=t.num_stages)

    if tiles is None:
        key = ("lora_shrink", max_segment_len <= 16, x.shape[1], lora_a.shape[2], x.dtype)
        tiles = choose(key, lora_candidates("shrink", max_segment_len, x.dtype), launch,
                       is_capturing=_is_capturing(x))
    launch(tiles)
    return out


def sgmv_expand(shrunk: torch.Tensor, lora_b: torch.Tensor, out: torch.Tensor, token_order: torch.Tensor,
                seg_starts: torch.Tensor, seg_slots: torch.Tensor, slot_ranks: torch.Tensor,
                max_segment_len: int, tiles: LoRATiles | None = None) -> torch.Tensor:
    """`out[token_order[i]] += shrunk[i, :rank] @ B[slot][:rank]` for every listed token, in place;
    `lora_b` (S, R_max, out). Returns `out`. `tiles`: as in sgmv_shrink."""
    _check(out, lora_b, "expand")
    if seg_slots.numel() == 0 or max_segment_len == 0:
        return out

    def launch(t: LoRATiles, target: torch.Tensor = out) -> None:
        grid = (seg_slots.numel(), triton.cdiv(max_segment_len, t.block_t), triton.cdiv(target.shape[1], t.block_out))
        _sgmv_expand_kernel[grid](
            shrunk, lora_b, target, token_order, seg_starts, seg_slots, slot_ranks,
            target.shape[1], shrunk.stride(0), lora_b.stride(0), lora_b.stride(1), target.stride(0),
            BLOCK_T=t.block_t, BLOCK_N=t.block_out, BLOCK_R=t.block_red, num_warps=t.num_warps,
            num_stages=t.num_stages)

    if tiles is None:
        key = ("lora_expand", max_segment_len <= 16, lora_b.shape[1], out.shape[1], out.dtype)
        scratch = None

        def timed(t: LoRATiles) -> None:  # autotuning times on a copy: the expand adds in place
            nonlocal scratch
            scratch = out.clone() if scratch is None else scratch
            launch(t, scratch)
        tiles = choose(key, lora_candidates("expand", max_segment_len, out.dtype), timed,
                       is_capturing=_is_capturing(out))
    launch(tiles)
    return out


def _is_capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()
