"""Paged attention behind a backend interface; `torch` is the reference that runs on any device.

The model runner orders a step's sequences decodes first, then prefill chunks that continue a
cached context, then fresh prompts, and builds one AttentionMetadata per step; every layer reuses
it. On the CPU in float32, the C kernels of kernels/cpu_paged_attention.py attend every sequence in
place in the paged cache (decodes one query per row, prefill chunks causally over their context).
Elsewhere (SDPA): decodes read dense staging rows; a fresh prompt (nothing cached before this
step) is attended in place on its slice of the step's q/k/v, no gather, no padding; everything
else is attended in groups, padded batches whose keys are gathered through the block tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchgen.engine.decode_staging import StagingStep
from batchgen.engine.kv_cache_manager import cache_slots
from batchgen.kernels import cpu_kv_store, cpu_paged_attention


@dataclass
class AttentionGroup:
    """A run of sequences attended together as one padded batch."""

    token_start: int  # first flat token of the group
    num_tokens: int
    query_index: torch.Tensor  # (B, Q) flat token index per padded query slot (num_tokens: padding)
    query_valid: torch.Tensor  # (B, Q) bool
    key_slots: torch.Tensor  # (B * K,) cache slot per key position, flattened (0 for padding)
    mask: torch.Tensor  # (B, 1, Q, K) bool, True = attend


@dataclass
class PagedDecode:
    """The decodes' block tables, for the CPU kernel that reads them in place."""

    block_tables: torch.Tensor  # (B, max_blocks) int32, padded with block 0
    lengths: torch.Tensor  # (B,) int32 keys per row, this step's token included
    block_size: int


@dataclass
class PagedPrefill:
    """The prefill chunks (fresh prompts and chunks with cached context alike), for the CPU kernel
    that reads their keys in place from the paged cache."""

    token_starts: torch.Tensor  # (S,) int32 first flat token of each chunk
    query_lens: torch.Tensor  # (S,) int32
    context_lens: torch.Tensor  # (S,) int32 tokens cached before this step
    block_tables: torch.Tensor  # (S, max_blocks) int32, padded with block 0
    block_size: int


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) cache slot for each new token
    groups: list[AttentionGroup]
    fresh: list[tuple[int, int]]  # (first flat token, num_tokens) of each fresh prompt, attended in place
    staging: StagingStep | None = None  # set when the decodes read dense staging rows
    num_decodes: int = 0  # the first tokens, one per decoding sequence
    paged_decode: PagedDecode | None = None  # set when the decodes are read in place by the CPU kernel
    paged_prefill: PagedPrefill | None = None  # set when the prefill chunks are, too


def build_attention_metadata(query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
                             num_decodes: int, block_size: int, device: torch.device,
                             staging: StagingStep | None = None,
                             is_paged: bool = False) -> AttentionMetadata:
    """context_lens[i] = tokens already in the cache before this step; query_lens[i] = new tokens.

    With `is_paged`, the CPU kernels read every sequence's keys in place from the paged cache.
    Otherwise: the first `num_decodes` sequences have one query each; with `staging` they read
    dense staging rows, else they form a gathered group. Prefill sequences with no cached context
    are attended in place; the others form padded groups (runs of them, in the caller's order).
    """
    slots: list[int] = []
    for q, c, table in zip(query_lens, context_lens, block_tables):
        slots.extend(cache_slots(table, c, c + q, block_size))
    slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    token_starts = [0]
    for q in query_lens:
        token_starts.append(token_starts[-1] + q)
    if is_paged:
        return AttentionMetadata(
            slot_mapping, [], [], None, num_decodes,
            _paged_decode(context_lens[:num_decodes], block_tables[:num_decodes], block_size, device)
            if num_decodes else None,
            _paged_prefill(token_starts[num_decodes:-1], query_lens[num_decodes:], context_lens[num_decodes:],
                           block_tables[num_decodes:], block_size, device)
            if len(query_lens) > num_decodes else None)
    first_gathered = num_decodes if staging is not None else 0
    ranges = [(first_gathered, num_decodes)] if num_decodes > first_gathered else []
    fresh: list[tuple[int, int]] = []
    run_start = num_decodes  # first sequence of the current run of prefills that gather
    for i in range(num_decodes, len(query_lens) + 1):
        if i < len(query_lens) and context_lens[i] > 0:
            continue
        ranges += _split_by_padding(query_lens, seq_lens, run_start, i)
        if i < len(query_lens):
            fresh.append((token_starts[i], query_lens[i]))
        run_start = i + 1
    groups = [_build_group(query_lens[lo:hi], context_lens[lo:hi], block_tables[lo:hi],
                           token_starts[lo], block_size, device) for lo, hi in ranges]
    return AttentionMetadata(slot_mapping, groups, fresh, staging, num_decodes)


def _padded_tables(block_tables: list[list[int]], lengths: list[int], block_size: int,
                   device: torch.device) -> torch.Tensor:
    """(S, max_blocks) int32: the blocks covering each sequence's first lengths[i] tokens, 0-padded."""
    num_blocks = [-(-n // block_size) for n in lengths]
    max_blocks = max(num_blocks)
    tables = [table[:n] + [0] * (max_blocks - n) for table, n in zip(block_tables, num_blocks)]
    return torch.tensor(tables, dtype=torch.int32, device=device)


def _paged_decode(context_lens: list[int], block_tables: list[list[int]], block_size: int,
                  device: torch.device) -> PagedDecode:
    lengths = [c + 1 for c in context_lens]
    return PagedDecode(_padded_tables(block_tables, lengths, block_size, device),
                       torch.tensor(lengths, dtype=torch.int32, device=device), block_size)


def _paged_prefill(token_starts: list[int], query_lens: list[int], context_lens: list[int],
                   block_tables: list[list[int]], block_size: int, device: torch.device) -> PagedPrefill:
    lengths = [c + q for c, q in zip(context_lens, query_lens)]

    def as_tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    return PagedPrefill(as_tensor(token_starts), as_tensor(query_lens), as_tensor(context_lens),
                        _padded_tables(block_tables, lengths, block_size, device), block_size)


def _split_by_padding(query_lens: list[int], seq_lens: list[int], lo: int, hi: int,
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
    )


class TorchAttention:
    """Reference paged attention. On the CPU in float32 (metadata built with is_paged): the C kernels,
    in place in the paged cache. Otherwise SDPA: fresh prompts in place (causal), other prefill
    chunks and unstaged decodes as gathered groups (masked), staged decodes from dense rows."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_kv: tuple,
                meta: AttentionMetadata) -> torch.Tensor:
        """layer_kv = (k_cache, v_cache[, StagingBuffers]); caches: (num_blocks * block_size, Hkv, D)."""
        # q: (T, H, D); k, v: (T, Hkv, D)
        k_cache, v_cache = layer_kv[0], layer_kv[1]
        if meta.paged_decode is not None or meta.paged_prefill is not None:  # the C kernels' path
            cpu_kv_store.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        else:
            k_cache.index_copy_(0, meta.slot_mapping, k)
            v_cache.index_copy_(0, meta.slot_mapping, v)
        is_decode_only = meta.num_decodes == q.shape[0]
        if meta.paged_decode is not None and is_decode_only:
            return self._paged_decode(q, k_cache, v_cache, meta.paged_decode)
        if meta.staging is not None and is_decode_only:
            return self._staged_decode(q, k, v, k_cache, v_cache, layer_kv[2], meta.staging)
        out = q.new_empty(q.shape)  # (T, H, D) contiguous
        end = meta.num_decodes
        if meta.paged_decode is not None:
            out[:end] = self._paged_decode(q[:end], k_cache, v_cache, meta.paged_decode)
        elif meta.staging is not None:
            out[:end] = self._staged_decode(q[:end], k[:end], v[:end], k_cache, v_cache, layer_kv[2], meta.staging)
        if meta.paged_prefill is not None:  # every prefill chunk in one call; no fresh list, no groups
            p = meta.paged_prefill
            cpu_paged_attention.paged_prefill_attention(q, k_cache, v_cache, p.token_starts, p.query_lens,
                                                        p.context_lens, p.block_tables, p.block_size, self.scale, out)
            return out
        is_gqa = self.num_heads != self.num_kv_heads
        for start, num_tokens in meta.fresh:
            # (1, heads, L, D) strided views of the sequence's own rows: SDPA's causal kernel reads
            # them in place and skips the masked half.
            end = start + num_tokens
            attn = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1)[None], k[start:end].transpose(0, 1)[None],
                v[start:end].transpose(0, 1)[None], is_causal=True, scale=self.scale, enable_gqa=is_gqa,
            )  # (1, H, L, D)
            out[start:end] = attn[0].transpose(0, 1)
        for g in meta.groups:
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
            attn = F.scaled_dot_product_attention(
                q_pad.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                attn_mask=g.mask, scale=self.scale, enable_gqa=is_gqa,
            )  # (B, H, Q, D)
            attn = attn.transpose(1, 2)[g.query_valid]  # (num_tokens, H, D), flat token order
            out[g.token_start:g.token_start + g.num_tokens] = attn
        return out

    def _paged_decode(self, q, k_cache, v_cache, paged: PagedDecode) -> torch.Tensor:
        # q: (B, H, D); a KV head's query heads go to the kernel together: GQA without expanding K/V.
        num_seqs = q.shape[0]
        q_rows = q.view(num_seqs, self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim)
        attn = cpu_paged_attention.paged_decode_attention(
            q_rows, k_cache, v_cache, paged.block_tables, paged.lengths, paged.block_size, self.scale)
        return attn.view(num_seqs, self.num_heads, self.head_dim)

    def _staged_decode(self, q, k, v, k_cache, v_cache, buffers, step: StagingStep) -> torch.Tensor:
        # q: (B, H, D) in staging-row order; k, v: (B, Hkv, D)
        num_seqs = q.shape[0]
        buffers.update(step, k_cache, v_cache, k, v)
        group = self.num_heads // self.num_kv_heads
        # A kv head's query heads act as `group` queries against it: GQA without expanding K/V.
        q_rows = q.view(num_seqs, self.num_kv_heads, group, self.head_dim)
        parts = [
            F.scaled_dot_product_attention(
                q_rows[r.first:r.end], buffers.k[r.first:r.end, :, :r.max_len],
                buffers.v[r.first:r.end, :, :r.max_len], attn_mask=r.mask, scale=self.scale,
            )  # (b, Hkv, group, D)
            for r in step.ranges
        ]
        attn = parts[0] if len(parts) == 1 else torch.cat(parts)
        return attn.reshape(num_seqs, self.num_heads, self.head_dim)


def make_attention_backend(name: str, num_heads: int, num_kv_heads: int, head_dim: int):
    if name == "torch":
        return TorchAttention(num_heads, num_kv_heads, head_dim)
    raise ValueError(
        f"attention_backend {name!r} is not available yet: the Triton paged-attention kernels are a "
        "later issue; use attention_backend: torch (or auto)"
    )
