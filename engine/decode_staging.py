"""Decode staging for the torch attention backend: a dense per-sequence copy of the paged KV.

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

from batchgen.engine.kv_cache_manager import cache_slots
from batchgen.engine.sequence import Sequence


@dataclass
class StagingStep:
    """What every layer does to its staging buffers in one step (decodes in row order 0..B-1)."""

    moves: list[tuple[int, int]]  # (src row, dst row), applied in order, before fills
    fill_rows: torch.Tensor  # (F,) rows that joined this step
    fill_slots: torch.Tensor  # (F * Lf,) paged-cache slots of their context (padded with slot 0)
    fill_len: int  # Lf
    positions: torch.Tensor  # (B,) where each row's new token goes
    mask: torch.Tensor  # (B, 1, 1, L) key position < row length
    max_len: int  # L: longest row after this step's token
    capacity: tuple[int, int]  # (rows, length) every layer's buffers must have


def staging_rows(num_rows: int) -> int:
    """Row capacity for `num_rows` rows: grows in steps of 16."""
    return -(-num_rows // 16) * 16


def staging_length(length: int) -> int:
    """Length capacity: grows in steps of 64 tokens (one reallocation every 64 decode steps)."""
    return -(-length // 64) * 64


class DecodeRows:
    """Assigns staging rows to decoding sequences; plans moves and fills for each step."""

    def __init__(self, block_size: int, max_tokens: int):
        self.block_size = block_size
        self.max_tokens = max_tokens  # rows x capacity allowed (memory cap); beyond it, no staging
        self.row_seqs: list[Sequence] = []
        self.capacity = (0, 0)  # (rows, length) the buffers hold; grows until reset
        self.num_resets = 0  # times staging switched off for lack of memory

    def can_stage(self, decodes: list[Sequence]) -> bool:
        rows, length = self._capacity_for(decodes)
        return rows * length <= self.max_tokens

    def _capacity_for(self, decodes: list[Sequence]) -> tuple[int, int]:
        longest = max(s.num_computed_tokens + 1 for s in decodes)
        return (max(self.capacity[0], staging_rows(len(decodes))),
                max(self.capacity[1], staging_length(longest)))

    def reset(self) -> None:
        self.row_seqs = []
        self.capacity = (0, 0)
        self.num_resets += 1

    def plan(self, decodes: list[Sequence], device: torch.device) -> tuple[list[Sequence], StagingStep]:
        """Rows for this step's decodes; returns them in row order with the step's staging plan."""
        self.capacity = self._capacity_for(decodes)
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
        joining = [s for s in decodes if id(s) not in staged]
        first_new = len(rows)
        rows.extend(joining)
        fill_len = max((s.num_computed_tokens for s in joining), default=0)
        fill_slots = []
        for s in joining:
            ctx = s.num_computed_tokens
            fill_slots.extend(cache_slots(s.block_ids, 0, ctx, self.block_size) + [0] * (fill_len - ctx))
        positions = [s.num_computed_tokens for s in rows]
        lengths = torch.tensor(positions) + 1
        max_len = int(lengths.max())
        mask = torch.arange(max_len)[None, :] < lengths[:, None]  # (B, L)
        step = StagingStep(
            moves=moves,
            fill_rows=torch.arange(first_new, len(rows), device=device),
            fill_slots=torch.tensor(fill_slots, dtype=torch.long, device=device),
            fill_len=fill_len,
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            mask=mask[:, None, None, :].to(device),
            max_len=max_len,
            capacity=self.capacity,
        )
        return list(rows), step


class StagingBuffers:
    """One layer's dense K and V mirrors, (rows, Hkv, C, D), grown on demand."""

    def __init__(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.k = torch.zeros((0, num_kv_heads, 0, head_dim), dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    def resize(self, num_rows: int, length: int) -> None:
        """Make the buffers (num_rows, Hkv, length, D), keeping what fits (a no-op when they are)."""
        rows, capacity = self.k.shape[0], self.k.shape[2]
        if (num_rows, length) == (rows, capacity):
            return
        keep_rows, keep_len = min(rows, num_rows), min(capacity, length)
        for name in ("k", "v"):
            old = getattr(self, name)
            # Zeros, not empty: masked keys still meet V in the weighted sum, and 0 * NaN is NaN.
            new = old.new_zeros(num_rows, old.shape[1], length, old.shape[3])
            new[:keep_rows, :, :keep_len] = old[:keep_rows, :, :keep_len]
            setattr(self, name, new)

    def update(self, step: StagingStep, k_cache: torch.Tensor, v_cache: torch.Tensor,
               k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Apply moves and fills, then append this step's token. k_new, v_new: (B, Hkv, D)."""
        self.resize(*step.capacity)
        for src, dst in step.moves:
            self.k[dst] = self.k[src]
            self.v[dst] = self.v[src]
        num_fills = step.fill_rows.numel()
        if num_fills and step.fill_len:
            for buf, cache in ((self.k, k_cache), (self.v, v_cache)):
                ctx = cache.index_select(0, step.fill_slots).view(num_fills, step.fill_len, *cache.shape[1:])
                buf[step.fill_rows, :, :step.fill_len] = ctx.transpose(1, 2)  # (F, Hkv, Lf, D)
        rows = torch.arange(k_new.shape[0], device=k_new.device)
        self.k[rows, :, step.positions] = k_new
        self.v[rows, :, step.positions] = v_new
