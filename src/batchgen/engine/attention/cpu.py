"""The CPU backend: the C kernels of kernels/cpu_paged_attention.py, in place in the paged cache.

On the CPU, queries in float32 or bfloat16, with a float32, bfloat16 or FP8 cache (FP8 read through
a 256-entry lookup table per layer, bfloat16 widened by a shift, see kernels/cpu_paged_attention.py);
float32 queries over a bfloat16 cache are the widened bf16 path (engine/capabilities.py). Every sequence's keys are read where they lie, through its block table: no
gather, no padding, no staging copy. Decodes go to the decode kernel (a KV head's query heads
together, GQA without expanding K/V); all prefill chunks of a step, fresh prompts and chunks that
continue a cached context alike, go to the prefill kernel in one call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.engine.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    AttentionMetadataBuilder,
    LayerAttention,
    build_slot_mapping,
    padded_block_tables,
    token_starts,
)
from batchgen.engine.attention.kv_cache import LayerKVCache
from batchgen.engine.runner.step_inputs import StepInputs
from batchgen.kernels import cpu_kv_store, cpu_paged_attention


@dataclass
class PagedDecode:
    """The decodes' block tables, for the kernel that reads them in place."""

    block_tables: torch.Tensor  # (B, max_blocks) int32, padded with block 0
    lengths: torch.Tensor  # (B,) int32 keys per row, this step's token included
    block_size: int


@dataclass
class PagedPrefill:
    """The prefill chunks (fresh prompts and chunks with cached context alike), for the kernel that
    reads their keys in place."""

    token_starts: torch.Tensor  # (S,) int32 first flat token of each chunk
    query_lens: torch.Tensor  # (S,) int32
    context_lens: torch.Tensor  # (S,) int32 tokens cached before this step
    block_tables: torch.Tensor  # (S, max_blocks) int32, padded with block 0
    block_size: int


@dataclass
class CpuAttentionMetadata(AttentionMetadata):
    decode: PagedDecode | None = None  # None: no decodes this step
    prefill: PagedPrefill | None = None  # None: no prefill chunks this step


class CpuMetadataBuilder(AttentionMetadataBuilder):
    """Stateless: the kernels need only the block tables and lengths of this step."""

    def __init__(self, block_size: int, device: torch.device):
        self.block_size = block_size
        self.device = device

    def build(self, query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
              num_decodes: int) -> CpuAttentionMetadata:
        block_size, device = self.block_size, self.device
        meta = CpuAttentionMetadata(build_slot_mapping(query_lens, context_lens, block_tables, block_size, device),
                                    num_decodes)
        if num_decodes:
            lengths = [c + 1 for c in context_lens[:num_decodes]]
            meta.decode = PagedDecode(padded_block_tables(block_tables[:num_decodes], lengths, block_size, device),
                                      torch.tensor(lengths, dtype=torch.int32, device=device), block_size)
        if len(query_lens) > num_decodes:
            starts = token_starts(query_lens)[num_decodes:-1]
            chunk_lens, chunk_contexts = query_lens[num_decodes:], context_lens[num_decodes:]
            lengths = [c + q for c, q in zip(chunk_contexts, chunk_lens)]

            def as_tensor(values: list[int]) -> torch.Tensor:
                return torch.tensor(values, dtype=torch.int32, device=device)

            meta.prefill = PagedPrefill(as_tensor(starts), as_tensor(chunk_lens), as_tensor(chunk_contexts),
                                        padded_block_tables(block_tables[num_decodes:], lengths, block_size, device),
                                        block_size)
        return meta

    def build_packed(self, step: StepInputs) -> CpuAttentionMetadata:
        """Views of the step's packed tensors: nothing is built per sequence."""
        num_decodes, num_seqs = step.num_decodes, step.num_seqs
        meta = CpuAttentionMetadata(step.slot_mapping.long(), num_decodes)  # int64 once, not per layer
        if num_decodes:
            meta.decode = PagedDecode(step.block_tables_t[:num_decodes], step.seq_lens[:num_decodes], self.block_size)
        if num_seqs > num_decodes:
            meta.prefill = PagedPrefill(step.query_start_loc[num_decodes:num_seqs], step.query_lens_t[num_decodes:],
                                        step.context_lens_t[num_decodes:], step.block_tables_t[num_decodes:],
                                        self.block_size)
        return meta


class CpuAttention(AttentionBackend):
    """Paged attention through the C kernels (CPU, float32 or bfloat16, head_dim a multiple of 16)."""

    name = "cpu"
    supports_fp8_kv = True

    @classmethod
    def unavailable_reason(cls, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        if device.type != "cpu":
            return f"its kernels run on the CPU, not on {device.type}"
        if dtype not in (torch.float32, torch.bfloat16):
            return f"its kernels take float32 or bfloat16, not {str(dtype).removeprefix('torch.')}"
        if head_dim % 16:
            return f"its kernels need head_dim a multiple of 16, this model has {head_dim}"
        if not (cpu_paged_attention.is_available() and cpu_kv_store.is_available()):
            return "its C kernels could not be built or loaded here (no C compiler, or not Linux; see the log)"
        return None

    def make_metadata_builder(self, num_layers: int, num_slots: int, block_size: int,
                              dtype: torch.dtype, device: torch.device) -> CpuMetadataBuilder:
        return CpuMetadataBuilder(block_size, device)

    def forward(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: LayerKVCache, meta: CpuAttentionMetadata, sinks: torch.Tensor | None = None) -> torch.Tensor:
        # q: (T, H, D); k, v: (T, Hkv, D); sinks: (H,) or None
        kv_cache.calibrate(k, v)
        k_cache, v_cache = kv_cache.k, kv_cache.v
        luts = kv_cache.lookup_tables() if kv_cache.is_fp8 else (None, None)
        cpu_kv_store.store_kv(k, v, k_cache, v_cache, meta.slot_mapping, kv_cache.k_scale, kv_cache.v_scale)
        num_decodes = meta.num_decodes
        layer = self.layer(layer_index)
        if meta.decode is not None and num_decodes == q.shape[0]:  # decode-only step: no output copy
            return self._decode(q, k_cache, v_cache, meta.decode, luts, layer, sinks)
        out = q.new_empty(q.shape)  # (T, H, D) contiguous
        if meta.decode is not None:
            out[:num_decodes] = self._decode(q[:num_decodes], k_cache, v_cache, meta.decode, luts, layer, sinks)
        if meta.prefill is not None:  # every prefill chunk in one call
            p = meta.prefill
            cpu_paged_attention.paged_prefill_attention(q, k_cache, v_cache, p.token_starts, p.query_lens,
                                                        p.context_lens, p.block_tables, p.block_size, self.scale, out,
                                                        *luts, sliding_window=layer.sliding_window,
                                                        softcap=layer.softcap, sinks=sinks)
        return out

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                paged: PagedDecode, luts: tuple, layer: LayerAttention,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        # q: (B, H, D); a KV head's query heads go to the kernel together: GQA without expanding K/V.
        num_seqs = q.shape[0]
        q_rows = q.view(num_seqs, self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim)
        attn = cpu_paged_attention.paged_decode_attention(
            q_rows, k_cache, v_cache, paged.block_tables, paged.lengths, paged.block_size, self.scale, *luts,
            sliding_window=layer.sliding_window, softcap=layer.softcap, sinks=sinks)
        return attn.view(num_seqs, self.num_heads, self.head_dim)
