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
from math import ceil

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
from batchgen.engine.runner.step_inputs import StepInputs

# Keys per KV chunk: the unit the kernel merges its online softmax in, split or not (a multiple of
# every candidate tile width). Longer chunks write fewer partials; shorter ones split short contexts.
SPLIT_SIZE = 512
# The interpreter's stand-in for a GPU's SM count (tests of the split choice on the CPU).
INTERPRETER_SM_COUNT = 16


@dataclass
class TritonAttentionMetadata(AttentionMetadata):
    block_tables: torch.Tensor | None = None  # (S, max_blocks) int32, padded with block 0
    cu_query_lens: torch.Tensor | None = None  # (S + 1,) int32 first flat token of each sequence, then T
    seq_lens: torch.Tensor | None = None  # (S,) int32 keys per sequence, this step's included
    block_size: int = 16
    split_size: int = SPLIT_SIZE
    # Split-KV's float32 scratch (acc (T, Hq, splits, head_pad), max, sum), or None: unsplit.
    workspace: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def device_sm_count(device: torch.device) -> int:
    """The device's streaming multiprocessors (INTERPRETER_SM_COUNT on the CPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_SM_COUNT


class TritonMetadataBuilder(AttentionMetadataBuilder):
    """Views of the step's packed tensors, and the split-KV choice with its workspace."""

    def __init__(self, block_size: int, device: torch.device, num_q_heads: int = 1, num_kv_heads: int = 1,
                 head_size: int = 64, num_sms: int | None = None):
        self.block_size = block_size
        self.device = device
        self.num_q_heads, self.num_kv_heads, self.head_size = num_q_heads, num_kv_heads, head_size
        self.num_sms = num_sms if num_sms is not None else device_sm_count(device)
        self.split_size = SPLIT_SIZE
        self.graph_workspaces: dict[tuple[int, int], tuple] = {}  # (tokens, splits) -> prepare_graph's

    def num_splits(self, num_seqs: int, max_seq_len: int, is_decode_only: bool) -> int:
        """Splits for a step (0: unsplit): decode-only, its sequences x KV heads fewer than the SMs,
        and a sequence that may span more than one chunk; enough splits for the longest."""
        if not is_decode_only or num_seqs * self.num_kv_heads >= self.num_sms:
            return 0
        splits = ceil(max_seq_len / self.split_size)
        return splits if splits > 1 else 0

    def _workspace(self, num_tokens: int, num_splits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from batchgen.kernels.triton_paged_attention import workspace_shape

        acc = torch.empty(workspace_shape(num_tokens, self.num_q_heads, self.head_size, num_splits),
                          dtype=torch.float32, device=self.device)
        return (acc, torch.empty(acc.shape[:3], dtype=torch.float32, device=self.device),
                torch.empty(acc.shape[:3], dtype=torch.float32, device=self.device))

    def prepare_graph(self, num_seqs: int, max_model_len: int) -> None:
        splits = self.num_splits(num_seqs, max_model_len, True)
        if splits:
            self.graph_workspaces[(num_seqs, splits)] = self._workspace(num_seqs, splits)

    def graph_workspace_bytes(self, sizes: list[int], max_model_len: int) -> int:
        from batchgen.kernels.triton_paged_attention import workspace_shape

        total = 0
        for size in sizes:
            splits = self.num_splits(size, max_model_len, True)
            if splits:
                tokens, heads, splits, head_pad = workspace_shape(size, self.num_q_heads, self.head_size, splits)
                total += 4 * tokens * heads * splits * (head_pad + 2)
        return total

    def build(self, query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
              num_decodes: int) -> TritonAttentionMetadata:
        device = self.device
        seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
        return TritonAttentionMetadata(
            build_slot_mapping(query_lens, context_lens, block_tables, self.block_size, device), num_decodes,
            block_tables=padded_block_tables(block_tables, seq_lens, self.block_size, device),
            cu_query_lens=torch.tensor(token_starts(query_lens), dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), block_size=self.block_size,
            split_size=self.split_size)

    def build_packed(self, step: StepInputs) -> TritonAttentionMetadata:
        """The step's packed tensors as they are: the kernels take int32 offsets, lengths and tables,
        so nothing is built here and a decode graph's capture records reads of its static buffers.
        A split step takes a graph size's prepared workspace when there is one, else a new one."""
        workspace = None
        splits = self.num_splits(step.num_seqs, step.max_seq_len, step.is_decode_only)
        if splits:
            workspace = self.graph_workspaces.get((step.num_tokens, splits)) or self._workspace(step.num_tokens,
                                                                                                  splits)
        return TritonAttentionMetadata(step.slot_mapping, step.num_decodes, block_tables=step.block_tables_t,
                                       cu_query_lens=step.query_start_loc, seq_lens=step.seq_lens,
                                       block_size=self.block_size, split_size=self.split_size, workspace=workspace)


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
        return TritonMetadataBuilder(block_size, device, self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: LayerKVCache, meta: TritonAttentionMetadata, sinks: torch.Tensor | None = None) -> torch.Tensor:
        # q: (T, H, D); k, v: (T, Hkv, D), views of the fused qkv output (head_dim contiguous)
        from batchgen.kernels.triton_kv_store import store_kv
        from batchgen.kernels.triton_paged_attention import paged_attention

        kv_cache.calibrate(k, v)
        scales = dict(k_scale=kv_cache.k_scale, v_scale=kv_cache.v_scale) if kv_cache.is_fp8 else {}
        store_kv(k, v, kv_cache.k, kv_cache.v, meta.slot_mapping, **scales)
        layer = self.layer(layer_index)
        return paged_attention(q, kv_cache.k, kv_cache.v, meta.block_tables, meta.cu_query_lens, meta.seq_lens,
                               self.scale, meta.block_size, split_size=meta.split_size, workspace=meta.workspace,
                               sliding_window=layer.sliding_window, softcap=layer.softcap, sinks=sinks,
                               **scales)  # (T, H, D)
