"""The attention backend interface: a step's metadata in, each layer's attention output out.

A backend is one way of attending a step's flat tokens against the paged KV cache. The engine
picks one when the model loads (selector.py) and every layer of the model calls it; nothing
outside engine/attention/ knows which one runs. Three pieces, as in vLLM v1:

- `AttentionBackend`: built once per model (shared by its layers and by engines that share the
  weights). `unavailable_reason` says whether it can run on a device/dtype/head size; `forward`
  writes this step's K/V into the layer's cache and attends.
- `AttentionMetadataBuilder`: one per model runner (per engine), made by the backend. It holds
  whatever per-engine state the backend keeps across steps and turns a step's sequences into
  the backend's `AttentionMetadata`, built once per step and read by every layer.
- `AttentionMetadata`: the fields every backend has (slot mapping, number of decodes) plus the
  backend's own, in a subclass.

Step layout (the runner's contract with every backend): the first `num_decodes` sequences are
decodes with one query token each, the rest are prefill chunks; a sequence's tokens are
contiguous in the flat batch, in sequence order.

To add a backend: one module with a subclass of each, registered in selector.py's
ATTENTION_BACKENDS (and, if `auto` should pick it, in AUTO_ORDER).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from batchgen.engine.attention.kv_cache import LayerKVCache
from batchgen.engine.core.sequence import Sequence
from batchgen.engine.kv.kv_cache_manager import cache_slots
from batchgen.engine.runner.step_inputs import StepInputs


@dataclass(frozen=True)
class LayerAttention:
    """What one layer's attention asks of the backend beyond causal softmax(q k^T * scale) v.

    `sliding_window` W: a query at position p sees keys at positions > p - W only (transformers'
    sliding_window_overlay: the last W positions, itself included); None: every earlier position.
    `softcap` c: scores (after the scale) become c * tanh(score / c) before the mask and the softmax
    (Gemma 2's attn_logit_softcapping); None: not capped.
    """

    sliding_window: int | None = None
    softcap: float | None = None


FULL_ATTENTION = LayerAttention()


@dataclass
class AttentionMetadata:
    """What every layer reads in one step; backends subclass it with their own fields."""

    slot_mapping: torch.Tensor  # (T,) int64 cache slot of each new token
    num_decodes: int  # the first num_decodes tokens are decodes, one per sequence


@dataclass
class WindowedMetadata:
    """A step's metadata when the sliding-window layers have their own block group (kv/window_groups.py):
    the same step built twice, over the full block tables and over the local ones (their slots and
    tables index the local layers' smaller caches). Each layer attends with its group's."""

    full: AttentionMetadata
    local: AttentionMetadata

    def for_layer(self, layer: LayerAttention) -> AttentionMetadata:
        return self.local if layer.sliding_window is not None else self.full


class AttentionMetadataBuilder(ABC):
    """One per model runner: turns each step's sequences into the backend's metadata."""

    def reorder_decodes(self, decodes: list[Sequence], num_live_seqs: int) -> list[Sequence]:
        """The order in which this step's decodes go into the batch (called once per step, before
        `build`; the default keeps the scheduler's). `num_live_seqs`: unfinished sequences that
        may decode soon. A backend that keeps per-sequence state plans it here."""
        return decodes

    @abstractmethod
    def build(self, query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
              num_decodes: int) -> AttentionMetadata:
        """Metadata for one step: per sequence, in batch order, its new tokens (query_lens[i]), the
        tokens already in the cache before this step (context_lens[i]) and its block table."""

    def build_packed(self, step: StepInputs) -> AttentionMetadata:
        """Metadata for one step from its packed inputs (engine/runner/step_inputs.py): device tensors that
        came over in the step's one copy (slot_mapping, query_start_loc, seq_lens, context_lens_t,
        query_lens_t, block_tables_t, all int32) and the host lengths.

        A backend that runs on a GPU overrides this and makes no tensor of its own from host data
        (that would be another host-to-device copy). For CUDA graphs (decode_graphs.py) it is called
        inside the capture of each batch size, on views of the graph's static buffers, with
        max_seq_len = max_model_len: device tensors it derives are then recomputed by every replay,
        and host values must be fixed for the batch size. The default goes through `build` (host lists; for backends that gather on the host).
        """
        return self.build(step.query_lens, step.context_lens, step.block_tables, step.num_decodes)

    def prepare_graph(self, num_seqs: int, max_model_len: int) -> None:
        """Called before the CUDA graph of `num_seqs` decodes is captured (decode_graphs.py), outside
        the capture: allocate whatever that graph's steps will use, so it is not allocated from the
        graph's pool nor per replay. The default keeps nothing."""

    def graph_workspace_bytes(self, sizes: list[int], max_model_len: int) -> int:
        """Bytes `prepare_graph` will hold for these graph sizes (reserved in the KV plan)."""
        return 0


class AttentionBackend(ABC):
    """Attention over the paged KV cache for one model's head layout; shared by all its layers.

    The cache of one layer is a LayerKVCache (kv_cache.py): K and V, each (num_blocks * block_size,
    Hkv, D) in the model dtype or FP8 (with one float32 scale per layer for each); slot = block *
    block_size + offset.
    """

    name: ClassVar[str]  # the value of `engine.attention_backend` that selects it
    supports_fp8_kv: ClassVar[bool] = False  # reads and writes FP8 caches (engine.kv_cache_dtype)

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5
        self.layers: tuple[LayerAttention, ...] = ()  # per layer_index; () = full attention everywhere

    def configure_layers(self, layers: list[LayerAttention], scale: float | None = None) -> None:
        """The model's per-layer windows and soft-caps (index = layer_index), and its softmax scale when
        it is not head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5). Called by the model when it
        is built; every backend reads them in `forward` through `layer`."""
        self.layers = tuple(layers)
        if scale is not None:
            self.scale = scale

    def layer(self, layer_index: int) -> LayerAttention:
        """Layer `layer_index`'s window and soft-cap."""
        return self.layers[layer_index] if self.layers else FULL_ATTENTION

    @classmethod
    @abstractmethod
    def unavailable_reason(cls, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        """None when this backend runs here; otherwise why not, in words (it ends up in an error)."""

    @abstractmethod
    def make_metadata_builder(self, num_layers: int, num_slots: int, block_size: int,
                              dtype: torch.dtype, device: torch.device) -> AttentionMetadataBuilder:
        """The per-runner half of the backend, for a cache of `num_slots` slots per layer."""

    @abstractmethod
    def forward(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: LayerKVCache, meta: AttentionMetadata, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Write k, v into the layer's cache at meta.slot_mapping (quantized for FP8, after
        `kv_cache.calibrate(k, v)`), then attend.

        q: (T, H, D); k, v: (T, Hkv, D), this step's tokens in batch order. Returns (T, H, D).
        `sinks` (H,): the layer's attention sinks (gpt-oss): a logit per query head that joins each
        softmax's denominator and weighs no value, as transformers' eager attention appends a sink
        column and drops it after the softmax. Passed only by a model that has them (None: none).
        """


def build_slot_mapping(query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
                       block_size: int, device: torch.device) -> torch.Tensor:
    """(T,) int64: the cache slot of every new token, sequences in batch order."""
    slots: list[int] = []
    for q, c, table in zip(query_lens, context_lens, block_tables):
        slots.extend(cache_slots(table, c, c + q, block_size))
    return torch.tensor(slots, dtype=torch.long, device=device)


def token_starts(query_lens: list[int]) -> list[int]:
    """First flat token of each sequence, plus the total at the end (len(query_lens) + 1 values)."""
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    return starts


def padded_block_tables(block_tables: list[list[int]], lengths: list[int], block_size: int,
                        device: torch.device) -> torch.Tensor:
    """(S, max_blocks) int32: the blocks covering each sequence's first lengths[i] tokens, 0-padded."""
    num_blocks = [-(-n // block_size) for n in lengths]
    max_blocks = max(num_blocks)
    tables = [table[:n] + [0] * (max_blocks - n) for table, n in zip(block_tables, num_blocks)]
    return torch.tensor(tables, dtype=torch.int32, device=device)
