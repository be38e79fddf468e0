"""The Triton backend: one KV-store launch and one paged-attention launch per layer per step, on CUDA.

kernels/triton_kv_store.py writes the step's keys and values into their slots (quantized for an FP8
cache); kernels/triton_paged_attention.py then attends every sequence of the step at once (decodes,
fresh prompts, chunks over a cached prefix, mixed) reading K and V in place through the block
tables: no staging copy, no gather, no per-sequence Python. Prefix and new tokens are read from the
cache alike, with fixed tiles and no split of the KV loop, so a token's result does not depend on
its batch mates or on how its prompt was chunked (batch invariance; a preempted sequence recomputes
bit for bit).

On the CPU it runs only under TRITON_INTERPRET=1 (tests: the same kernels, float32/float16; the
interpreter's bfloat16 dots are wrong). The kernel modules are imported on first use, so that the
interpreter setting is read when they are.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from batchgen.engine.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    AttentionMetadataBuilder,
    build_slot_mapping,
    padded_block_tables,
    token_starts,
)
from batchgen.engine.attention.kv_cache import LayerKVCache
from batchgen.engine.step_inputs import StepInputs


@dataclass
class TritonAttentionMetadata(AttentionMetadata):
    block_tables: torch.Tensor | None = None  # (S, max_blocks) int32, padded with block 0
    cu_query_lens: torch.Tensor | None = None  # (S + 1,) int32 first flat token of each sequence, then T
    seq_lens: torch.Tensor | None = None  # (S,) int32 keys per sequence, this step's included
    block_size: int = 16


class TritonMetadataBuilder(AttentionMetadataBuilder):
    """Stateless: the kernels need only this step's block tables, query offsets and lengths."""

    def __init__(self, block_size: int, device: torch.device):
        self.block_size = block_size
        self.device = device

    def build(self, query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
              num_decodes: int) -> TritonAttentionMetadata:
        device = self.device
        seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
        return TritonAttentionMetadata(
            build_slot_mapping(query_lens, context_lens, block_tables, self.block_size, device), num_decodes,
            block_tables=padded_block_tables(block_tables, seq_lens, self.block_size, device),
            cu_query_lens=torch.tensor(token_starts(query_lens), dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), block_size=self.block_size)

    def build_packed(self, step: StepInputs) -> TritonAttentionMetadata:
        """The step's packed tensors as they are: the kernels take int32 offsets, lengths and tables,
        so nothing is built here and a decode graph's capture records reads of its static buffers."""
        return TritonAttentionMetadata(step.slot_mapping, step.num_decodes, block_tables=step.block_tables_t,
                                       cu_query_lens=step.query_start_loc, seq_lens=step.seq_lens,
                                       block_size=self.block_size)


def _triton_reason() -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    return None


class TritonAttention(AttentionBackend):
    """Paged attention through the Triton kernels (CUDA; the CPU under TRITON_INTERPRET=1)."""

    name = "triton"
    supports_fp8_kv = True

    @classmethod
    def unavailable_reason(cls, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        reason = _triton_reason()
        if reason is not None:
            return reason
        if device.type == "cpu":
            if os.environ.get("TRITON_INTERPRET") != "1":
                return "its kernels run on CUDA (on the CPU only under TRITON_INTERPRET=1, for tests)"
            if dtype not in (torch.float32, torch.float16):
                return f"the Triton interpreter computes float32/float16 only, not {str(dtype).removeprefix('torch.')}"
            return None
        if device.type != "cuda":
            return f"its kernels run on CUDA, not on {device.type}"
        return None

    def make_metadata_builder(self, num_layers: int, num_slots: int, block_size: int,
                              dtype: torch.dtype, device: torch.device) -> TritonMetadataBuilder:
        if block_size % 16:
            raise ValueError(f"attention_backend triton needs engine.block_size a multiple of 16, got {block_size}")
        return TritonMetadataBuilder(block_size, device)

    def forward(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: LayerKVCache, meta: TritonAttentionMetadata) -> torch.Tensor:
        # q: (T, H, D); k, v: (T, Hkv, D), views of the fused qkv output (head_dim contiguous)
        from batchgen.kernels.triton_kv_store import store_kv
        from batchgen.kernels.triton_paged_attention import paged_attention

        kv_cache.calibrate(k, v)
        scales = dict(k_scale=kv_cache.k_scale, v_scale=kv_cache.v_scale) if kv_cache.is_fp8 else {}
        store_kv(k, v, kv_cache.k, kv_cache.v, meta.slot_mapping, **scales)
        return paged_attention(q, kv_cache.k, kv_cache.v, meta.block_tables, meta.cu_query_lens, meta.seq_lens,
                               self.scale, meta.block_size, **scales)  # (T, H, D)
