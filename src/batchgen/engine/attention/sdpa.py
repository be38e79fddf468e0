"""The SDPA backend: torch's scaled_dot_product_attention, the CPU's fallback.

It runs where neither the C kernels nor Triton do: on the CPU in bfloat16/float16, without a C
compiler, or with a head_dim that is not a multiple of 16. Never on CUDA (the Triton backend reads
the cache in place there; the staging mirror below would take as much memory again as the KV pool),
and never with an FP8 KV cache.

SDPA needs its keys dense, so the paged cache is read three ways:
- decodes read dense staging rows (decode_staging.py): a per-sequence copy of the KV gathered once
  when the sequence starts decoding and appended to in place, capped at the pool's own size;
- a fresh prompt (nothing cached before this step) is attended in place on its slice of the
  step's q/k/v, causal, no gather, no padding;
- everything else (prefill chunks that continue a cached context, decodes when staging does not
  fit) is attended in groups: padded batches whose keys are gathered through the block tables.

A layer with a sliding window (base.LayerAttention) narrows each of these masks to the keys inside
its window (built once per step and window, shared by the layers); a soft-capped layer attends
through `attend`'s explicit softmax (SDPA has no soft-cap).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from batchgen.engine.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    AttentionMetadataBuilder,
    LayerAttention,
    build_slot_mapping,
    token_starts,
)
from batchgen.engine.attention.decode_staging import DecodeRows, StagingBuffers, StagingPool, StagingStep
from batchgen.engine.core.sequence import Sequence


@dataclass
class AttentionGroup:
    """A run of sequences attended together as one padded batch."""

    token_start: int  # first flat token of the group
    num_tokens: int
    query_index: torch.Tensor  # (B, Q) flat token index per padded query slot (num_tokens: padding)
    query_valid: torch.Tensor  # (B, Q) bool
    key_slots: torch.Tensor  # (B * K,) cache slot per key position, flattened (0 for padding)
    mask: torch.Tensor  # (B, 1, Q, K) bool, True = attend
    query_positions: torch.Tensor | None = None  # (B, 1, Q, 1) absolute position of each query slot


@dataclass
class SdpaAttentionMetadata(AttentionMetadata):
    groups: list[AttentionGroup] = field(default_factory=list)
    fresh: list[tuple[int, int]] = field(default_factory=list)  # (first flat token, num_tokens) per fresh prompt
    staging: StagingStep | None = None  # set when the decodes read dense staging rows
    staging_buffers: list[StagingBuffers] | None = None  # per layer, with `staging`
    # Sliding-window masks built this step, by (what, index, window): shared by the layers of one window.
    window_masks: dict = field(default_factory=dict)

    def windowed(self, key: tuple, make) -> torch.Tensor:
        """The mask cached under `key`, made by `make()` on first use this step."""
        if key not in self.window_masks:
            self.window_masks[key] = make()
        return self.window_masks[key]


class SdpaMetadataBuilder(AttentionMetadataBuilder):
    """Keeps the decode staging rows of one engine: which sequence owns which row, and the buffers."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_slots: int, block_size: int,
                 dtype: torch.dtype, device: torch.device):
        self.block_size = block_size
        self.device = device
        # Staging is capped at the pool's own size, so it never more than doubles KV memory.
        self.decode_rows = DecodeRows(block_size, num_kv_heads, max_tokens=num_slots)
        self.staging_pool = StagingPool(num_layers, num_kv_heads, head_dim, dtype, device)
        self._staging: StagingStep | None = None  # planned by reorder_decodes, used by the next build

    def reorder_decodes(self, decodes: list[Sequence], num_live_seqs: int) -> list[Sequence]:
        """Staging-row order when the rows fit under the memory cap; otherwise staging is dropped
        (its memory given back) and the decodes are gathered until it fits again."""
        self._staging = None
        if decodes and self.decode_rows.can_stage(decodes, num_live_seqs):
            row_seqs, self._staging = self.decode_rows.plan(decodes, self.device, num_live_seqs)
            self.staging_pool.resize(*self._staging.capacity)
            return row_seqs
        if self.decode_rows.capacity != (0, 0):
            self.decode_rows.reset()
            self.staging_pool.resize(0, 0)  # rows refill when staging resumes
        return decodes

    def build(self, query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
              num_decodes: int) -> SdpaAttentionMetadata:
        """The first `num_decodes` sequences have one query each; staged (when reorder_decodes
        planned it) they read dense rows, else they form a gathered group. Prefill sequences with no
        cached context are attended in place; the others form padded groups (runs of them, in the
        caller's order)."""
        staging, self._staging = self._staging, None
        block_size, device = self.block_size, self.device
        slot_mapping = build_slot_mapping(query_lens, context_lens, block_tables, block_size, device)
        seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
        starts = token_starts(query_lens)
        first_gathered = num_decodes if staging is not None else 0
        ranges = [(first_gathered, num_decodes)] if num_decodes > first_gathered else []
        fresh: list[tuple[int, int]] = []
        run_start = num_decodes  # first sequence of the current run of prefills that gather
        for i in range(num_decodes, len(query_lens) + 1):
            if i < len(query_lens) and context_lens[i] > 0:
                continue
            ranges += split_by_padding(query_lens, seq_lens, run_start, i)
            if i < len(query_lens):
                fresh.append((starts[i], query_lens[i]))
            run_start = i + 1
        groups = [_build_group(query_lens[lo:hi], context_lens[lo:hi], block_tables[lo:hi],
                               starts[lo], block_size, device) for lo, hi in ranges]
        return SdpaAttentionMetadata(slot_mapping, num_decodes, groups, fresh, staging,
                                     self.staging_pool.layers if staging is not None else None)


def split_by_padding(query_lens: list[int], seq_lens: list[int], lo: int, hi: int,
                     max_waste: float = 2.0, slack: int = 4096) -> list[tuple[int, int]]:
    """Cut [lo, hi) into contiguous groups whose padded (B x Q x K) attention stays within
    `max_waste` x the useful work, so one long prompt never pads many short ones to its length.
    Callers order sequences by query length so that neighbours pad little."""
    ranges = []
    start, max_q, max_k, useful = lo, 0, 0, 0
    for i in range(lo, hi):
        q, k = query_lens[i], seq_lens[i]
        new_q, new_k, new_useful = max(max_q, q), max(max_k, k), useful + q * k
        if i > start and (i - start + 1) * new_q * new_k > max_waste * new_useful + slack:
            ranges.append((start, i))
            start, new_q, new_k, new_useful = i, q, k, q * k
        max_q, max_k, useful = new_q, new_k, new_useful
    if hi > start:
        ranges.append((start, hi))
    return ranges


def _build_group(query_lens, context_lens, block_tables, token_start, block_size, device) -> AttentionGroup:
    num_seqs = len(query_lens)
    max_q = max(query_lens)
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    max_k = max(seq_lens)
    num_tokens = sum(query_lens)
    q_lens = torch.tensor(query_lens)
    c_lens = torch.tensor(context_lens)
    starts = torch.cumsum(q_lens, 0) - q_lens
    q_pos = torch.arange(max_q)
    query_valid = q_pos[None, :] < q_lens[:, None]  # (B, Q)
    query_index = torch.where(query_valid, starts[:, None] + q_pos[None, :], torch.full_like(query_valid, num_tokens, dtype=torch.long))
    max_blocks = -(-max_k // block_size)
    tables = torch.zeros(num_seqs, max_blocks, dtype=torch.long)
    for i, t in enumerate(block_tables):
        n = min(len(t), max_blocks)
        tables[i, :n] = torch.tensor(t[:n])
    k_pos = torch.arange(max_k)
    key_slots = tables[:, k_pos // block_size] * block_size + (k_pos % block_size)[None, :]  # (B, K)
    # Query i of sequence b sits at absolute position c_b + i and sees keys 0..c_b + i.
    abs_q = c_lens[:, None] + q_pos[None, :]  # (B, Q)
    mask = k_pos[None, None, :] <= abs_q[:, :, None]  # (B, Q, K)
    mask &= query_valid[:, :, None]
    mask |= ~query_valid[:, :, None] & (k_pos[None, None, :] == 0)  # padding rows: avoid all-masked NaN
    return AttentionGroup(
        token_start=token_start, num_tokens=num_tokens,
        query_index=query_index.to(device), query_valid=query_valid.to(device),
        key_slots=key_slots.flatten().to(device), mask=mask[:, None].to(device),
        query_positions=abs_q[:, None, :, None].to(device),
    )


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
           softcap: float | None, is_gqa: bool, is_causal: bool = False,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scale [soft-capped], masked) v: q (B, H, Q, D), k, v (B, Hkv, K, D), mask
    broadcastable to (B, H, Q, K) bool (True = attend) or None (then `is_causal`). SDPA without a cap;
    with one, the scores are capped explicitly (in float32), as transformers' eager attention does.
    `sinks` broadcastable to (B, H, Q, 1): a logit per row joining the denominator and weighing no value
    (gpt-oss; explicit too: a sink column appended to the scores and dropped after the softmax, as
    transformers' eager attention does)."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal and mask is None,
                                              scale=scale, enable_gqa=is_gqa)
    if is_gqa:
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # (B, H, Q, K)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None and is_causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril(scores.shape[-1] - scores.shape[-2])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = scores.softmax(-1)
    else:
        sink = sinks.float().expand(*scores.shape[:-1], 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    return torch.matmul(probs, v.float()).to(q.dtype)


def causal_window_mask(length: int, window: int, device: torch.device) -> torch.Tensor:
    """(L, L) bool: query i sees keys j with i - window < j <= i."""
    pos = torch.arange(length, device=device)
    offset = pos[:, None] - pos[None, :]  # (Q, K) query position - key position
    return (offset >= 0) & (offset < window)


class SdpaAttention(AttentionBackend):
    """Staged decodes from dense rows, fresh prompts in place (causal), other prefill chunks and
    unstaged decodes as gathered groups (masked)."""

    name = "sdpa"

    @classmethod
    def unavailable_reason(cls, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        if device.type != "cpu":
            return f"it is the CPU's fallback; on {device.type} attention runs through the Triton kernels"
        return None  # torch's SDPA runs in every dtype the engine supports

    def make_metadata_builder(self, num_layers: int, num_slots: int, block_size: int,
                              dtype: torch.dtype, device: torch.device) -> SdpaMetadataBuilder:
        return SdpaMetadataBuilder(num_layers, self.num_kv_heads, self.head_dim, num_slots, block_size, dtype, device)

    def forward(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache, meta: SdpaAttentionMetadata, sinks: torch.Tensor | None = None) -> torch.Tensor:
        # q: (T, H, D); k, v: (T, Hkv, D); sinks: (H,) or None
        k_cache, v_cache = kv_cache
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        is_decode_only = meta.num_decodes == q.shape[0]
        staging = meta.staging
        if staging is not None and is_decode_only:
            return self._staged_decode(q, k, v, k_cache, v_cache, meta.staging_buffers[layer_index], staging,
                                       self.layer(layer_index), meta, sinks)
        out = q.new_empty(q.shape)  # (T, H, D) contiguous
        end = meta.num_decodes
        if staging is not None:
            out[:end] = self._staged_decode(q[:end], k[:end], v[:end], k_cache, v_cache,
                                            meta.staging_buffers[layer_index], staging, self.layer(layer_index), meta,
                                            sinks)
        is_gqa = self.num_heads != self.num_kv_heads
        layer = self.layer(layer_index)
        window, softcap = layer.sliding_window, layer.softcap
        head_sinks = None if sinks is None else sinks.view(1, -1, 1, 1)  # (1, H, 1, 1): one per query head
        for start, num_tokens in meta.fresh:
            # (1, heads, L, D) strided views of the sequence's own rows: SDPA's causal kernel reads
            # them in place and skips the masked half.
            end = start + num_tokens
            mask = None
            if window is not None and num_tokens > window:
                mask = meta.windowed(("fresh", num_tokens, window),
                                     lambda: causal_window_mask(num_tokens, window, q.device))
            attn = attend(q[start:end].transpose(0, 1)[None], k[start:end].transpose(0, 1)[None],
                          v[start:end].transpose(0, 1)[None], mask, self.scale, softcap, is_gqa,
                          is_causal=True, sinks=head_sinks)  # (1, H, L, D)
            out[start:end] = attn[0].transpose(0, 1)
        for index, g in enumerate(meta.groups):
            num_seqs, max_q = g.query_index.shape
            q_group = q[g.token_start:g.token_start + g.num_tokens]
            if max_q == 1:  # decodes: one query per sequence, already in order
                q_pad = q_group.unsqueeze(1)  # (B, 1, H, D)
            else:
                q_group = torch.cat([q_group, q_group.new_zeros(1, *q_group.shape[1:])])
                q_pad = q_group.index_select(0, g.query_index.flatten()).view(num_seqs, max_q, *q.shape[1:])
            # index_select copies whole (Hkv, D) rows: several times faster than advanced indexing on CPU.
            keys = k_cache.index_select(0, g.key_slots).view(num_seqs, -1, *k_cache.shape[1:])  # (B, K, Hkv, D)
            values = v_cache.index_select(0, g.key_slots).view(num_seqs, -1, *v_cache.shape[1:])
            mask = g.mask
            if window is not None:  # keys before the window masked too; padding rows keep their key 0
                mask = meta.windowed(("group", index, window), lambda: _group_window_mask(g, window))
            attn = attend(q_pad.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                          mask, self.scale, softcap, is_gqa, sinks=head_sinks)  # (B, H, Q, D)
            attn = attn.transpose(1, 2)[g.query_valid]  # (num_tokens, H, D), flat token order
            out[g.token_start:g.token_start + g.num_tokens] = attn
        return out

    def _staged_decode(self, q, k, v, k_cache, v_cache, buffers: StagingBuffers, step: StagingStep,
                       layer: LayerAttention, meta: SdpaAttentionMetadata,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
        # q: (B, H, D) in staging-row order; k, v: (B, Hkv, D)
        num_seqs = q.shape[0]
        buffers.update(step, k_cache, v_cache, k, v)
        group = self.num_heads // self.num_kv_heads
        # A kv head's query heads act as `group` queries against it: GQA without expanding K/V.
        q_rows = q.view(num_seqs, self.num_kv_heads, group, self.head_dim)
        window = layer.sliding_window
        masks = [r.mask if window is None else
                 meta.windowed(("staged", i, window), lambda: _row_window_mask(r.mask, window))
                 for i, r in enumerate(step.ranges)]
        parts = [
            attend(q_rows[r.first:r.end], buffers.k[r.first:r.end, :, :r.max_len],
                   buffers.v[r.first:r.end, :, :r.max_len], mask, self.scale, layer.softcap, is_gqa=False,
                   sinks=None if sinks is None else sinks.view(1, self.num_kv_heads, group, 1))  # (b, Hkv, group, D)
            for r, mask in zip(step.ranges, masks)
        ]
        attn = parts[0] if len(parts) == 1 else torch.cat(parts)
        return attn.reshape(num_seqs, self.num_heads, self.head_dim)


def _group_window_mask(g: AttentionGroup, window: int) -> torch.Tensor:
    """(B, 1, Q, K) a group's causal mask narrowed to each valid query's window."""
    k_pos = torch.arange(g.mask.shape[-1], device=g.mask.device)
    in_window = k_pos > g.query_positions - window  # (B, 1, Q, K)
    return g.mask & (in_window | ~g.query_valid[:, None, :, None])


def _row_window_mask(mask: torch.Tensor, window: int) -> torch.Tensor:
    """(b, 1, 1, L) staged decode rows' masks (key < row length) narrowed to their last `window` keys."""
    lengths = mask.sum(-1, keepdim=True)  # (b, 1, 1, 1)
    return mask & (torch.arange(mask.shape[-1], device=mask.device) >= lengths - window)
