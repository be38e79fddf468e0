"""Decode staging for the SDPA backend: a dense per-sequence copy of the paged KV.

Gathering every decode sequence's keys and values out of the paged cache in every layer of every
step copies the whole working set each step (the same O(context) copy that makes HF's growing
cache slow). Instead, each sequence that decodes gets a row in a dense (rows, Hkv, C, D) buffer:
its context is gathered once when it joins, each new token is appended in place, and rows are
compacted when sequences leave. The paged cache stays the truth (prefix sharing, preemption);
the staging rows are a per-layer mirror that decode attention reads without any gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.engine.core.sequence import Sequence
from batchgen.engine.kv.kv_cache_manager import cache_slots


@dataclass
class RowRange:
    """Staging rows [first, end) attended as one batch, reading keys [0, max_len)."""

    first: int
    end: int
    max_len: int
    mask: torch.Tensor  # (end - first, 1, 1, max_len) key position < row length


@dataclass
class StagingStep:
    """What every layer does to its staging buffers in one step (decodes in row order 0..B-1)."""

    moves: list[tuple[int, int]]  # (src row, dst row), applied in order, before fills
    fill_rows: tuple[int, int]  # [first, end): rows that joined this step (always the last F rows)
    fill_slots: torch.Tensor  # (F * Lf,) paged-cache slots of their context (padded with slot 0)
    fill_len: int  # Lf
    append_index: torch.Tensor  # (B * Hkv,) flat (row, head, position) index of each row's new token
    ranges: list[RowRange]  # row ranges of similar length, attended separately (less padding)
    max_len: int  # L: longest row after this step's token
    capacity: tuple[int, int]  # (rows, length) every layer's buffers must have


def staging_rows(num_rows: int) -> int:
    """Row capacity for `num_rows` rows: grows in steps of 16."""
    return -(-num_rows // 16) * 16


def staging_length(length: int) -> int:
    """Length capacity: a multiple of 64 tokens."""
    return -(-length // 64) * 64


def row_ranges(lengths: list[int], max_waste: float = 1.1, slack: int = 512) -> list[tuple[int, int]]:
    """Cut rows into contiguous ranges whose padded reads (rows x longest) stay within `max_waste` x
    the real keys (+ `slack`); rows are kept roughly length-ordered, so neighbours pad little."""
    ranges = []
    first, longest, total = 0, 0, 0
    for i, n in enumerate(lengths):
        new_longest, new_total = max(longest, n), total + n
        if i > first and (i - first + 1) * new_longest > max_waste * new_total + slack:
            ranges.append((first, i))
            first, new_longest, new_total = i, n, n
        longest, total = new_longest, new_total
    if lengths:
        ranges.append((first, len(lengths)))
    return ranges


class DecodeRows:
    """Assigns staging rows to decoding sequences; plans moves and fills for each step."""

    def __init__(self, block_size: int, num_kv_heads: int, max_tokens: int,
                 range_max_waste: float = 1.1, range_slack: int = 512):
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.max_tokens = max_tokens  # rows x capacity allowed (memory cap); beyond it, no staging
        self.row_seqs: list[Sequence] = []
        self.capacity = (0, 0)  # (rows, length) the buffers hold; grows until reset
        self.range_max_waste, self.range_slack = range_max_waste, range_slack  # row_ranges() rule

    def can_stage(self, decodes: list[Sequence], num_expected_rows: int = 0) -> bool:
        rows, length = self._capacity_for(decodes, num_expected_rows)
        return rows * length <= self.max_tokens

    def _capacity_for(self, decodes: list[Sequence], num_expected_rows: int = 0) -> tuple[int, int]:
        """Grown capacity with headroom (rows for every sequence expected to decode soon, twice the
        longest row's length) when the memory cap allows it: buffers are allocated uninitialized,
        so headroom costs address space, not touched memory, and saves reallocations."""
        rows, length = self.capacity
        needed_rows = staging_rows(len(decodes))
        needed_len = staging_length(max(s.num_computed_tokens + 1 for s in decodes))
        if needed_rows <= rows and needed_len <= length:
            return rows, length
        roomy = (max(rows, needed_rows, staging_rows(num_expected_rows)), max(length, 2 * needed_len))
        if roomy[0] * roomy[1] <= self.max_tokens:
            return roomy
        return max(rows, needed_rows), max(length, needed_len)

    def reset(self) -> None:
        """Drop every row (staging switched off for lack of memory)."""
        self.row_seqs = []
        self.capacity = (0, 0)

    def plan(self, decodes: list[Sequence], device: torch.device,
             num_expected_rows: int = 0) -> tuple[list[Sequence], StagingStep]:
        """Rows for this step's decodes; returns them in row order with the step's staging plan.
        `num_expected_rows`: sequences that may decode soon (the engine passes its unfinished ones)."""
        self.capacity = self._capacity_for(decodes, num_expected_rows)
        current = {id(s) for s in decodes}
        rows = self.row_seqs
        moves: list[tuple[int, int]] = []
        # Compact: fill each hole with the last live row (one row copy per departure).
        i = 0
        while i < len(rows):
            if id(rows[i]) in current:
                i += 1
                continue
            while rows and id(rows[-1]) not in current:
                rows.pop()
            if i < len(rows):
                moves.append((len(rows) - 1, i))
                rows[i] = rows.pop()
                i += 1
        staged = {id(s) for s in rows}
        # Longest first: rows stay roughly ordered by length, so row_ranges() pads little.
        joining = sorted((s for s in decodes if id(s) not in staged), key=lambda s: -s.num_computed_tokens)
        first_new = len(rows)
        rows.extend(joining)
        fill_len = max((s.num_computed_tokens for s in joining), default=0)
        fill_slots = []
        for s in joining:
            ctx = s.num_computed_tokens
            fill_slots.extend(cache_slots(s.block_ids, 0, ctx, self.block_size) + [0] * (fill_len - ctx))
        positions = torch.tensor([s.num_computed_tokens for s in rows])
        lengths = (positions + 1).tolist()
        capacity_len = self.capacity[1]
        row_heads = torch.arange(len(rows) * self.num_kv_heads)  # row * Hkv + head
        append_index = row_heads * capacity_len + positions.repeat_interleave(self.num_kv_heads)
        ranges = []
        for first, end in row_ranges(lengths, self.range_max_waste, self.range_slack):
            range_len = max(lengths[first:end])
            mask = torch.arange(range_len)[None, :] < torch.tensor(lengths[first:end])[:, None]  # (b, L)
            ranges.append(RowRange(first, end, range_len, mask[:, None, None, :].to(device)))
        step = StagingStep(
            moves=moves,
            fill_rows=(first_new, len(rows)),
            fill_slots=torch.tensor(fill_slots, dtype=torch.long, device=device),
            fill_len=fill_len,
            append_index=append_index.to(device),
            ranges=ranges,
            max_len=max(lengths),
            capacity=self.capacity,
        )
        return list(rows), step


class StagingBuffers:
    """One layer's dense K and V mirrors, (rows, Hkv, C, D): views into its StagingPool's storage.

    What attention reads is kept finite: every live row holds its own keys or zeros in
    [0, valid_len), because masked keys still meet V in the weighted sum and 0 * NaN is NaN.
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor, valid_len: int):
        self.k, self.v = k, v
        self.valid_len = valid_len  # columns [0, valid_len) of every live row are written (keys or zeros)

    def update(self, step: StagingStep, k_cache: torch.Tensor, v_cache: torch.Tensor,
               k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Apply moves and fills, then append this step's token. k_new, v_new: (B, Hkv, D).
        The pool has already been resized to step.capacity."""
        num_rows, valid = k_new.shape[0], self.valid_len
        # Columns no row has written yet are zeroed 64 at a time (one strided pass per 64 steps).
        new_valid = max(valid, min(staging_length(step.max_len), self.k.shape[2]))
        for buf in (self.k, self.v):
            for src, dst in step.moves:
                buf[dst, :, :valid] = buf[src, :, :valid]
            if new_valid > valid:
                buf[:num_rows, :, valid:new_valid] = 0
        self.valid_len = new_valid
        first_fill, end_fill = step.fill_rows
        if end_fill > first_fill:
            # Row slices, not an index tensor: a strided copy runs several times faster than index_put_.
            for buf, cache in ((self.k, k_cache), (self.v, v_cache)):
                rows = buf[first_fill:end_fill]
                if step.fill_len:
                    ctx = cache.index_select(0, step.fill_slots).view(end_fill - first_fill, step.fill_len, *cache.shape[1:])
                    rows[:, :, :step.fill_len] = ctx.transpose(1, 2)  # (F, Hkv, Lf, D)
                rows[:, :, step.fill_len:self.valid_len] = 0  # a joined row's stale tail
        head_dim = self.k.shape[-1]
        self.k.view(-1, head_dim).index_copy_(0, step.append_index, k_new.reshape(-1, head_dim))
        self.v.view(-1, head_dim).index_copy_(0, step.append_index, v_new.reshape(-1, head_dim))


class StagingPool:
    """Every layer's staging buffers in one (layers, 2, rows, Hkv, C, D) allocation.

    One allocation, made before the step's forward pass, so that growing the buffers does not
    interleave long-lived blocks with each layer's transient activations (that interleaving made
    the allocator hand out fresh pages to every layer's MLP: docs/benchmarks/history/cpu-throughput.md,
    change 10). Allocated uninitialized: untouched pages cost nothing.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.storage = torch.empty((num_layers, 2, 0, num_kv_heads, 0, head_dim), dtype=dtype, device=device)
        self.layers = [StagingBuffers(kv[0], kv[1], 0) for kv in self.storage]

    @property
    def capacity(self) -> tuple[int, int]:
        return self.storage.shape[2], self.storage.shape[4]

    def resize(self, num_rows: int, length: int) -> None:
        """Make every layer's buffers (num_rows, Hkv, length, D), keeping what fits (a no-op when they are)."""
        if (num_rows, length) == self.capacity:
            return
        old = self.storage
        new = old.new_empty(old.shape[0], 2, num_rows, old.shape[3], length, old.shape[5])
        keep_rows = min(old.shape[2], num_rows)
        for i, layer in enumerate(self.layers):
            keep_len = min(layer.valid_len, length)
            new[i, :, :keep_rows, :, :keep_len] = old[i, :, :keep_rows, :, :keep_len]
            self.layers[i] = StagingBuffers(new[i, 0], new[i, 1], keep_len)
        self.storage = new
