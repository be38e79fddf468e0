"""Paged attention for a whole engine step in one launch: decodes, fresh prefills and prefill chunks
over a cached prefix, mixed, read in place from the slot-major KV cache through the block tables.

Layout. q (T, Hq, D) is flat over the step's tokens, sequence by sequence (cu_query_lens). The KV
store has already written this step's keys and values, so every key a query sees is in the cache:
seq_lens counts the cached tokens including this step's, and a query at chunk position i of a
sequence with context c = seq_len - query_len sees keys [0, c + i]. Prefix and new tokens are read
by the same loop, so a token's result does not depend on how its prompt was chunked.

Programs. One program per (query tile of one sequence, kv head). GQA is folded into the tile's rows:
BLOCK_M rows = BLOCK_Q queries x G query heads of one kv head (row r: query r // G, head r % G), so
each K/V tile is loaded once for all G heads. A query tile finds its sequence on the device by binary
search over cu_query_lens: sequence s owns tiles [cu[s] // BLOCK_Q + s, ...), which bounds the number
of tiles by T // BLOCK_Q + S. The grid therefore depends only on T, S and the tile sizes, never on
the query lengths (no host sync, CUDA-graph safe); tiles past their sequence's queries exit at once.

Batch invariance. Tile sizes are fixed, query tiles start at each sequence's own first token, and the
KV loop walks tiles of TILE_N keys from position 0 in order, so a row's arithmetic does not depend on
its batch mates. A query tile stops at the last key its last query sees; for its earlier queries the
extra keys are masked, which leaves their running max, sum and accumulator bitwise unchanged (scale
1, additions of exact zeros): a token gives the same bits as a decode or inside a prefill chunk.
Keep the tiles (AttentionTiles) and split_size fixed for an engine's lifetime.

KV chunks and split-KV. The KV loop runs in chunks of split_size keys (a multiple of TILE_N): each
chunk's online softmax starts afresh and is merged into the running result (`_merge`) in chunk
order. Split-KV (a `workspace` given) runs one program per chunk instead, writing its float32 partial
result, and a second kernel merges them with the same `_merge` in the same order: the two modes give
bitwise the same output (when the workspace's splits cover the sequence; past them the last split
takes every remaining chunk), so a backend may choose per step, by how many programs the batch
fills, without changing any token. It pays off for long contexts at small batch.

Tiles and warps (AttentionTiles) come from kernels/triton_tuning.py: a fixed choice per head size,
query-head group and dtype (the first of its candidates, unless BATCHGEN_TRITON_AUTOTUNE=1 times them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.kernels.triton_kv_store import check_kv_scales, is_fp8_kv
from batchgen.kernels.triton_tuning import AttentionTiles, attention_candidates, choose

_LOG2E = 1.4426950408889634
DEFAULT_SPLIT_SIZE = 512  # keys per KV chunk: a multiple of every candidate TILE_N


@triton.jit
def _merge(total_max, total_sum, total_acc, part_max, part_sum, part_acc):
    # One chunk's (max, sum, acc) into the running ones (rows: query heads). An empty chunk (max -inf,
    # sum 0, acc 0) leaves them bitwise unchanged; the first non-empty one becomes them exactly.
    new_max = tl.maximum(total_max, part_max)
    safe_max = tl.where(new_max > float("-inf"), new_max, 0.0)
    alpha = tl.exp2(total_max - safe_max)
    beta = tl.exp2(part_max - safe_max)
    return new_max, total_sum * alpha + part_sum * beta, total_acc * alpha[:, None] + part_acc * beta[:, None]


@triton.jit
def _merge_sink(total_max, total_sum, total_acc, sinks_ptr, heads, is_row):
    # The rows' sink logits (natural units, one per query head: gpt-oss) as one more key of weight
    # exp(sink) and value 0, merged last: they join the denominator and weigh no value. The unsplit
    # kernel and the split combine both merge it after every chunk, so the two modes stay bitwise equal.
    sink = tl.load(sinks_ptr + heads, mask=is_row, other=0.0).to(tl.float32) * 1.4426950408889634
    return _merge(total_max, total_sum, total_acc, sink, total_sum * 0.0 + 1.0, tl.zeros_like(total_acc))


@triton.jit
def _tanh(x):
    # tanh through exp2 (no libdevice call, so the interpreter runs it too): 1 - 2 / (e^2x + 1) is
    # exact to an ulp of 1 and saturates to +-1 without overflow trouble (e^2x = inf gives 1).
    e = tl.exp2(x * 2.8853900817779268)  # 2 * log2(e)
    return 1.0 - 2.0 / (e + 1.0)


@triton.jit
def _find_seq_idx(cu_q_ptr, q_tile, num_seqs, BLOCK_Q: tl.constexpr):
    # The last sequence s whose first query tile, cu[s] // BLOCK_Q + s, is <= q_tile.
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(cu_q_ptr + mid) // BLOCK_Q + mid
        if first_tile <= q_tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_tables_ptr, cu_q_ptr, seq_lens_ptr, k_scale_ptr, v_scale_ptr,
    part_acc_ptr, part_max_ptr, part_sum_ptr,
    sinks_ptr,  # HAS_SINKS: (Hq,) float32 sink logits in natural units
    qk_scale,  # sm_scale * log2(e): the softmax runs in base 2
    softcap,  # HAS_SOFTCAP: scores (natural units) become softcap * tanh(score / softcap)
    window,  # HAS_WINDOW: a query at position p sees keys at positions > p - window only
    num_seqs,
    stride_q_t, stride_q_h,
    stride_k_s, stride_k_h, stride_v_s, stride_v_h,
    stride_o_t, stride_o_h,
    stride_bt_s,
    stride_pa_t, stride_pa_h, stride_pa_s,  # partial acc (T, Hq, MAX_SPLITS, HEAD_PAD)
    stride_pm_t, stride_pm_h,  # partial max / sum (T, Hq, MAX_SPLITS)
    NUM_QUERIES_PER_KV: tl.constexpr,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
    IS_FP8: tl.constexpr, IS_FP32: tl.constexpr,
    IS_SPLIT: tl.constexpr, TILES_PER_CHUNK: tl.constexpr, MAX_SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    q_tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq_idx(cu_q_ptr, q_tile, num_seqs, BLOCK_Q)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    local_tile = q_tile - (q_start // BLOCK_Q + seq)
    if local_tile * BLOCK_Q >= q_len:
        return  # a spare tile: the grid's bound exceeds this sequence's tiles
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_pos = local_tile * BLOCK_Q + rows // NUM_QUERIES_PER_KV  # (BLOCK_M,) query index in the chunk
    heads = kv_head * NUM_QUERIES_PER_KV + rows % NUM_QUERIES_PER_KV  # (BLOCK_M,) query head
    is_row = (rows < BLOCK_Q * NUM_QUERIES_PER_KV) & (q_pos < q_len)
    tokens = (q_start + q_pos).to(tl.int64)
    dims = tl.arange(0, HEAD_PAD)
    is_dim = dims < HEAD_SIZE
    q = tl.load(q_ptr + tokens[:, None] * stride_q_t + heads[:, None] * stride_q_h + dims[None, :],
                mask=is_row[:, None] & is_dim[None, :], other=0.0)  # (BLOCK_M, HEAD_PAD)
    last_key = context_len + q_pos  # (BLOCK_M,) the last key each row sees (causal)

    # Keys this tile's last query sees; tiles past them are skipped, not masked.
    num_keys = tl.minimum(context_len + (local_tile + 1) * BLOCK_Q, seq_len)
    num_tiles = tl.cdiv(num_keys, TILE_N)
    num_chunks = tl.cdiv(num_tiles, TILES_PER_CHUNK)
    # Sliding window: tiles wholly before the first key the tile's first query sees are skipped. A
    # skipped tile would be masked for every row, which leaves max, sum and acc bitwise as they are,
    # so a token's result still does not depend on its query tile (batch invariance holds).
    first_tile = 0
    if HAS_WINDOW:
        first_tile = tl.maximum(context_len + local_tile * BLOCK_Q - window + 1, 0) // TILE_N
    if IS_SPLIT:
        split = tl.program_id(2)
        chunk_lo = split
        # The last split takes every remaining chunk, so no key is lost past max_num_splits splits.
        if split == MAX_SPLITS - 1:
            chunk_hi = num_chunks
        else:
            chunk_hi = tl.minimum(split + 1, num_chunks)
    else:
        chunk_lo = first_tile // TILES_PER_CHUNK
        chunk_hi = num_chunks
    if IS_FP8:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)

    total_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    total_sum = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    total_acc = tl.full([BLOCK_M, HEAD_PAD], 0.0, dtype=tl.float32)
    offs_n = tl.arange(0, TILE_N)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt_s
    k_head = k_cache_ptr + kv_head * stride_k_h
    v_head = v_cache_ptr + kv_head * stride_v_h
    for chunk in range(chunk_lo, chunk_hi):
        row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        row_sum = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
        acc = tl.full([BLOCK_M, HEAD_PAD], 0.0, dtype=tl.float32)
        for tile in range(tl.maximum(chunk * TILES_PER_CHUNK, first_tile),
                          tl.minimum((chunk + 1) * TILES_PER_CHUNK, num_tiles)):
            pos = tile * TILE_N + offs_n  # (TILE_N,) key positions
            is_key = pos < seq_len
            block = tl.load(block_table + pos // BLOCK_SIZE, mask=is_key, other=0).to(tl.int64)
            slot = block * BLOCK_SIZE + pos % BLOCK_SIZE  # (TILE_N,) int64
            k = tl.load(k_head + slot[None, :] * stride_k_s + dims[:, None],
                        mask=is_key[None, :] & is_dim[:, None], other=0.0)  # (HEAD_PAD, TILE_N)
            v = tl.load(v_head + slot[:, None] * stride_v_s + dims[None, :],
                        mask=is_key[:, None] & is_dim[None, :], other=0.0)  # (TILE_N, HEAD_PAD)
            if IS_FP8:
                k = (k.to(tl.float32) * k_scale).to(q.dtype)
                v = (v.to(tl.float32) * v_scale).to(q.dtype)
            if IS_FP32:
                scores = tl.dot(q, k, input_precision="ieee")  # no silent TF32 for float32 models
            else:
                scores = tl.dot(q, k)
            scores = scores * qk_scale  # (BLOCK_M, TILE_N)
            if HAS_SOFTCAP:  # capped in natural units, then back to base 2
                scores = softcap * 1.4426950408889634 * _tanh(scores / (softcap * 1.4426950408889634))
            is_seen = (pos[None, :] <= last_key[:, None]) & is_key[None, :]
            if HAS_WINDOW:
                is_seen = is_seen & (pos[None, :] > last_key[:, None] - window)
            scores = tl.where(is_seen, scores, float("-inf"))
            new_max = tl.maximum(row_max, tl.max(scores, 1))
            # A row with no key yet (a later chunk of a prefill row, or a spare row) keeps max -inf:
            # exponents against 0 then give 0 instead of NaN.
            safe_max = tl.where(new_max > float("-inf"), new_max, 0.0)
            p = tl.exp2(scores - safe_max[:, None])
            alpha = tl.exp2(row_max - safe_max)
            row_sum = row_sum * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            if IS_FP32:
                acc += tl.dot(p, v, input_precision="ieee")
            else:
                acc += tl.dot(p.to(v.dtype), v)
            row_max = new_max
        total_max, total_sum, total_acc = _merge(total_max, total_sum, total_acc, row_max, row_sum, acc)

    if IS_SPLIT:
        split = tl.program_id(2)
        part = tokens * stride_pm_t + heads * stride_pm_h + split  # (BLOCK_M,)
        tl.store(part_max_ptr + part, total_max, mask=is_row)
        tl.store(part_sum_ptr + part, total_sum, mask=is_row)
        tl.store(part_acc_ptr + tokens[:, None] * stride_pa_t + heads[:, None] * stride_pa_h
                 + split * stride_pa_s + dims[None, :], total_acc, mask=is_row[:, None])
    else:
        if HAS_SINKS:
            total_max, total_sum, total_acc = _merge_sink(total_max, total_sum, total_acc, sinks_ptr, heads, is_row)
        out = total_acc / total_sum[:, None]
        tl.store(out_ptr + tokens[:, None] * stride_o_t + heads[:, None] * stride_o_h + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=is_row[:, None] & is_dim[None, :])


@triton.jit
def _combine_splits_kernel(
    part_acc_ptr, part_max_ptr, part_sum_ptr, out_ptr, sinks_ptr,
    stride_pa_t, stride_pa_h, stride_pa_s, stride_pm_t, stride_pm_h, stride_o_t, stride_o_h,
    NUM_QUERIES_PER_KV: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, MAX_SPLITS: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    # One program per (token, kv head): the group's query heads as rows.
    token = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    rows = tl.arange(0, GROUP_PAD)
    heads = kv_head * NUM_QUERIES_PER_KV + rows  # (GROUP_PAD,)
    is_row = rows < NUM_QUERIES_PER_KV
    dims = tl.arange(0, HEAD_PAD)
    part_row = token * stride_pm_t + heads * stride_pm_h  # (GROUP_PAD,)
    acc_row = token * stride_pa_t + heads[:, None] * stride_pa_h + dims[None, :]  # (GROUP_PAD, HEAD_PAD)
    # In split order, with the attention kernel's own merge: the unsplit kernel's result bit for bit.
    total_max = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    total_sum = tl.full([GROUP_PAD], 0.0, dtype=tl.float32)
    total_acc = tl.full([GROUP_PAD, HEAD_PAD], 0.0, dtype=tl.float32)
    for split in range(MAX_SPLITS):
        part_max = tl.load(part_max_ptr + part_row + split, mask=is_row, other=float("-inf"))
        part_sum = tl.load(part_sum_ptr + part_row + split, mask=is_row, other=0.0)
        part_acc = tl.load(part_acc_ptr + acc_row + split * stride_pa_s, mask=is_row[:, None], other=0.0)
        total_max, total_sum, total_acc = _merge(total_max, total_sum, total_acc, part_max, part_sum, part_acc)
    if HAS_SINKS:
        total_max, total_sum, total_acc = _merge_sink(total_max, total_sum, total_acc, sinks_ptr, heads, is_row)
    out = total_acc / tl.where(is_row, total_sum, 1.0)[:, None]  # padding rows of the group: no 0 / 0
    tl.store(out_ptr + token * stride_o_t + heads[:, None] * stride_o_h + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=is_row[:, None] & (dims[None, :] < HEAD_SIZE))


def workspace_shape(num_tokens: int, num_q_heads: int, head_size: int, max_num_splits: int) -> tuple[int, ...]:
    """Split-KV's float32 partial acc (T, Hq, splits, head_pad); max and sum are its first three dims."""
    return num_tokens, num_q_heads, max_num_splits, triton.next_power_of_2(head_size)


def num_query_tiles(num_tokens: int, num_seqs: int, num_queries_per_kv: int, block_m: int) -> int:
    """The grid's first dimension: an upper bound on the query tiles of any step of this size."""
    return num_tokens // max(block_m // num_queries_per_kv, 1) + num_seqs


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    cu_query_lens: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float, block_size: int, *,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
    split_size: int = DEFAULT_SPLIT_SIZE,
    workspace: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    tiles: AttentionTiles | None = None, sliding_window: int | None = None, softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal paged attention of one engine step -> (T, Hq, D) in q's dtype (written into `out` if given).

    q (T, Hq, D) float16/bfloat16/float32, head size contiguous (a view of a fused qkv is fine).
    k_cache, v_cache (num_slots, Hkv, D), slot = block * block_size + offset, in q's dtype or FP8
    (float8_e4m3fn / float8_e5m2, then k_scale and v_scale: one float32 value each, on the device).
    block_tables (S, max_blocks) int32: the blocks of each sequence, read only below its seq_len.
    cu_query_lens (S+1,) int32: cu[0] = 0, sequence s owns tokens [cu[s], cu[s+1]) of q; cu[S] = T.
    seq_lens (S,) int32: cached tokens of each sequence, this step's included (the KV store ran).
    A sequence with zero query tokens is allowed (nothing written for it). Padding rows, e.g. of a
    CUDA-graph batch: one query token, seq_len 1, a block table whose first entry is a valid block
    (slot -1 in the KV store): their output is the value at that slot, finite, and ignored.

    split_size: keys per KV chunk (a multiple of tiles.tile_n), the same in both modes. `workspace`:
    split-KV, one program per chunk, into float32 tensors of `workspace_shape(T, Hq, D, splits)`
    (acc) and its first three dims (max, sum); splits sized from the longest possible sequence.
    `tiles`: kernels/triton_tuning.py's choice for this shape when None. Values are not checked (that
    would need a device sync); only shapes, dtypes and strides are.
    `sliding_window` W: a query at position p sees keys at positions > p - W only (transformers'
    sliding window: the last W positions, itself included). `softcap` c: scores become
    c * tanh(score / c) before the softmax (Gemma 2). `sinks` (Hq,) on q's device: a logit per query
    head (natural units, after any cap) that joins the softmax's denominator and weighs no value
    (gpt-oss's attention sinks). None: off.
    """
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1 (or None), got {sliding_window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive (or None), got {softcap}")
    _check_inputs(q, k_cache, v_cache, block_tables, cu_query_lens, seq_lens, block_size, k_scale, v_scale)
    num_tokens, num_q_heads, head_size = q.shape
    if sinks is not None:
        if sinks.shape != (num_q_heads,) or sinks.device != q.device:
            raise ValueError(f"sinks must be ({num_q_heads},) on q's device, got {tuple(sinks.shape)} on {sinks.device}")
        sinks = sinks.detach().to(torch.float32).contiguous()
    group = num_q_heads // k_cache.shape[1]
    is_fp8 = is_fp8_kv(k_cache.dtype)
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1 or out.device != q.device:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype}, contiguous in head_size, on q's device")
    if workspace is not None:
        part_acc, part_max, part_sum = workspace
        max_num_splits = part_acc.shape[2] if part_acc.dim() == 4 else 0
        if (max_num_splits < 1 or part_acc.shape != workspace_shape(num_tokens, num_q_heads, head_size, max_num_splits)
                or part_max.shape != part_acc.shape[:3] or part_sum.shape != part_acc.shape[:3]
                or any(t.dtype != torch.float32 or not t.is_contiguous() or t.device != q.device for t in workspace)):
            raise ValueError(f"workspace must be contiguous float32 tensors on q's device: acc "
                             f"{workspace_shape(num_tokens, num_q_heads, head_size, 1)[:2]} + (splits, head_pad), "
                             f"max and sum its first three dims")
    if num_tokens == 0:
        return out

    def launch(config: AttentionTiles) -> None:
        if split_size <= 0 or split_size % config.tile_n:
            raise ValueError(f"split_size must be a positive multiple of tile_n={config.tile_n}, got {split_size}")
        _launch(q, k_cache, v_cache, out, block_tables, cu_query_lens, seq_lens, k_scale, v_scale, workspace,
                sm_scale, block_size, split_size, group, is_fp8, config, sliding_window, softcap, sinks)

    if tiles is None:
        candidates = attention_candidates(head_size, group, q.dtype, is_fp8)
        tiles = choose(("paged_attention", head_size, group, q.dtype, k_cache.dtype), candidates, launch,
                       is_capturing=q.is_cuda and torch.cuda.is_current_stream_capturing())
    launch(tiles)
    return out


def _launch(q, k_cache, v_cache, out, block_tables, cu_query_lens, seq_lens, k_scale, v_scale, workspace,
            sm_scale: float, block_size: int, split_size: int, group: int, is_fp8: bool,
            tiles: AttentionTiles, sliding_window: int | None = None, softcap: float | None = None,
            sinks: torch.Tensor | None = None) -> None:
    num_tokens, _, head_size = q.shape
    num_seqs, num_kv_heads = seq_lens.shape[0], k_cache.shape[1]
    block_m = max(tiles.block_m, triton.next_power_of_2(group))  # one query per tile, all its heads
    is_split = workspace is not None
    part_acc, part_max, part_sum = workspace if is_split else (out, out, out)  # unsplit: never dereferenced
    max_num_splits = part_acc.shape[2] if is_split else 1
    head_pad = triton.next_power_of_2(head_size)
    grid = (num_query_tiles(num_tokens, num_seqs, group, block_m), num_kv_heads, max_num_splits)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, cu_query_lens, seq_lens,
        k_scale if is_fp8 else q, v_scale if is_fp8 else q,
        part_acc, part_max, part_sum, sinks if sinks is not None else q,  # q: never dereferenced
        sm_scale * _LOG2E, float(softcap or 1.0), int(sliding_window or 1), num_seqs,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1),
        block_tables.stride(0),
        part_acc.stride(0) if is_split else 0, part_acc.stride(1) if is_split else 0,
        part_acc.stride(2) if is_split else 0,
        part_max.stride(0) if is_split else 0, part_max.stride(1) if is_split else 0,
        NUM_QUERIES_PER_KV=group, HEAD_SIZE=head_size, HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_Q=max(block_m // group, 1), TILE_N=tiles.tile_n,
        IS_FP8=is_fp8, IS_FP32=q.dtype == torch.float32,
        IS_SPLIT=is_split, TILES_PER_CHUNK=split_size // tiles.tile_n, MAX_SPLITS=max_num_splits,
        HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=softcap is not None, HAS_SINKS=sinks is not None,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    if is_split:
        _combine_splits_kernel[(num_tokens, num_kv_heads)](
            part_acc, part_max, part_sum, out, sinks if sinks is not None else out,
            part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
            part_max.stride(0), part_max.stride(1), out.stride(0), out.stride(1),
            NUM_QUERIES_PER_KV=group, GROUP_PAD=triton.next_power_of_2(group),
            HEAD_SIZE=head_size, HEAD_PAD=head_pad, MAX_SPLITS=max_num_splits, HAS_SINKS=sinks is not None,
        )


def _check_inputs(q, k_cache, v_cache, block_tables, cu_query_lens, seq_lens, block_size: int,
                  k_scale, v_scale) -> None:
    """Shapes, dtypes, strides and devices (no values: that would need a device sync)."""
    if q.dim() != 3 or k_cache.dim() != 3:
        raise ValueError(f"expected q (T, Hq, D) and k_cache (num_slots, Hkv, D); "
                         f"got {tuple(q.shape)} and {tuple(k_cache.shape)}")
    num_q_heads, head_size = q.shape[1:]
    if v_cache.shape != k_cache.shape or k_cache.shape[2] != head_size:
        raise ValueError(f"k_cache and v_cache must both be (num_slots, Hkv, {head_size}), "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if num_q_heads % k_cache.shape[1]:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {k_cache.shape[1]} kv heads")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache and v_cache dtypes differ: {k_cache.dtype}, {v_cache.dtype}")
    if is_fp8_kv(k_cache.dtype):
        check_kv_scales(k_scale, v_scale, q.device)
    elif k_cache.dtype != q.dtype:
        raise ValueError(f"the cache must be in q's dtype {q.dtype} or FP8, got {k_cache.dtype}")
    if seq_lens.dim() != 1 or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be (S,) int32, got {tuple(seq_lens.shape)} {seq_lens.dtype}")
    num_seqs = seq_lens.shape[0]
    if cu_query_lens.shape != (num_seqs + 1,) or cu_query_lens.dtype != torch.int32:
        raise ValueError(f"cu_query_lens must be ({num_seqs + 1},) int32, "
                         f"got {tuple(cu_query_lens.shape)} {cu_query_lens.dtype}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be ({num_seqs}, max_blocks) int32, "
                         f"got {tuple(block_tables.shape)} {block_tables.dtype}")
    if not (seq_lens.is_contiguous() and cu_query_lens.is_contiguous()) or block_tables.stride(1) != 1:
        raise ValueError("seq_lens, cu_query_lens and block_tables' rows must be contiguous")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_size (stride(-1) == 1)")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
                    ("cu_query_lens", cu_query_lens), ("seq_lens", seq_lens)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if block_size <= 0 or block_size % 16:
        raise ValueError(f"block_size must be a positive multiple of 16, got {block_size}")
