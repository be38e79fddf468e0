"""CUDA graphs for decode-only steps: one graph per batch size, captured at start-up, one memory pool.

A decode-only step of n sequences replays the graph of the smallest captured size B >= n. The
graph reads static device buffers: the step's packed tensors are copied into their first n rows
(device-to-device), and rows n..B-1 are padding: token 0 at position 0, slot -1 (the KV store
writes nothing), one key to attend (seq_len 1, through a block table whose entries are valid
blocks). Their logits are computed and dropped. Decode-only steps have fixed query offsets
(query_start_loc = 0, 1, ..., B) and logits rows (0..B-1), so those buffers never change.
Prefill and mixed steps, and batches above the largest size, run eagerly. The LM head runs in the
graph; the sampler runs outside it.

Sizes: 1, 2, 4, 8, then every multiple of 16 up to the largest (engine.max_cuda_graph_size, else
max_num_seqs), and the largest itself: 20 graphs at 256 instead of 35 with steps of 8 (start-up
time and graph memory). A padded step computes at most 15 spare rows: over batch sizes 1..256
taken alike, 5.6% more rows than real ones (2.7% with steps of 8), small beside the weights a
decode step streams whatever its batch.
They are captured largest first, so the smaller graphs reuse the first one's pool; that pool holds
about one eager decode step's activations at the largest size, which the KV plan reserves before
sizing the pool (engine/kv/gpu_memory.py, `DecodeGraphs.static_bytes` for the buffers outside it;
`decode_graph_profiler` measures both for the plan, in this process or a tensor-parallel worker).

The capture itself goes through a `capturer` (CudaGraphCapturer on CUDA) so the padding and the
size selection run on the CPU in tests with an eager stand-in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from batchgen.engine.attention.base import WindowedMetadata
from batchgen.engine.runner.step_inputs import StepInputs, make_step_inputs

if TYPE_CHECKING:
    from batchgen.engine.config import EngineConfig
    from batchgen.engine.runner.model_runner import ModelRunner

GRAPH_SIZE_STEP = 16  # past 8: one graph per 16 sequences


def graph_batch_sizes(max_size: int) -> list[int]:
    """Batch sizes to capture, ascending: 1, 2, 4, 8, 16, 32, ... (multiples of 16), and max_size."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_size]
    sizes += list(range(GRAPH_SIZE_STEP, max_size + 1, GRAPH_SIZE_STEP))
    if sizes[-1] != max_size:
        sizes.append(max_size)
    return sizes


def padded_batch_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds num_seqs rows; None when none does (run eagerly)."""
    for size in sizes:
        if size >= num_seqs:
            return size
    return None


class CudaGraphCapturer:
    """Captures a function as a CUDA graph; every graph shares the first one's memory pool."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = None

    def capture(self, fn):
        """-> (replay, output): replay() re-runs the captured kernels, which rewrite `output`."""
        fn()  # warm-up outside the graph: compiles kernels, settles allocations
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = fn()
        if self.pool is None:
            self.pool = graph.pool()
        return graph.replay, output


class EagerCapturer:
    """A stand-in for tests: `replay` calls the function again and writes its result into `output`."""

    def __init__(self):
        self.num_captures = 0
        self.num_replays = 0

    def capture(self, fn):
        self.num_captures += 1
        output = fn()

        def replay():
            self.num_replays += 1
            output.copy_(fn())

        return replay, output


class DecodeGraphs:
    """The captured decode graphs of one model runner and the static buffers they read."""

    def __init__(self, model, kv_caches: list, attention, max_size: int, max_model_len: int,
                 block_size: int, device: torch.device, capturer=None, has_local_tables: bool = False):
        """`has_local_tables`: the sliding-window layers have their own block group (kv/window_groups.py):
        their slots and tables get static buffers too, and each graph builds both metadata."""
        self.model = model
        self.kv_caches = kv_caches
        self.attention = attention
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.sizes = graph_batch_sizes(max_size)
        self.capturer = capturer if capturer is not None else CudaGraphCapturer(device)
        b = self.sizes[-1]
        # One column more than max_model_len needs: a sequence at the length limit still fits
        # (nano-vllm's off-by-one, its issues #190/#191).
        width = -(-max_model_len // block_size) + 1

        def zeros(*shape):
            return torch.zeros(shape, dtype=torch.int32, device=device)

        self.input_ids = zeros(b)
        self.positions = zeros(b)
        self.slot_mapping = torch.full((b,), -1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(b, dtype=torch.int32, device=device)
        self.context_lens = zeros(b)
        self.query_lens = torch.ones(b, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(b, dtype=torch.int32, device=device)
        self.block_tables = zeros(b, width)
        self.local_slot_mapping = torch.full((b,), -1, dtype=torch.int32, device=device) if has_local_tables else None
        self.local_block_tables = zeros(b, width) if has_local_tables else None
        # One logits buffer for every graph (each writes its first `size` rows), not one per size:
        # 20 sizes x 128k-wide float32 rows would hold ~1 GB for Llama-3's vocabulary.
        self.logits = torch.empty((b, model.vocab_size), dtype=torch.float32, device=device)
        self.graphs: dict[int, tuple] = {}  # size -> (replay, logits (size, V))
        self.capture_seconds = 0.0  # set by the runner once captured
        self.memory_bytes = 0  # CUDA: device memory the capture took (its pool and these buffers)

    @staticmethod
    def static_bytes(max_size: int, max_model_len: int, block_size: int, vocab_size: int,
                     has_local_tables: bool = False) -> int:
        """Bytes of the buffers the graphs read and write outside their pool: the float32 logits and
        the int32 step buffers (DecodeGraphs.__init__)."""
        width = -(-max_model_len // block_size) + 1
        local = max_size * (1 + width) if has_local_tables else 0
        return 4 * max_size * vocab_size + 4 * (max_size * (8 + width) + 1 + local)

    def fits(self, num_seqs: int) -> bool:
        return padded_batch_size(num_seqs, self.sizes) is not None

    def static_step(self, size: int) -> StepInputs:
        """Views of the static buffers as the StepInputs of a `size`-row decode step."""
        tensors = {"input_ids": self.input_ids[:size], "positions": self.positions[:size],
                   "slot_mapping": self.slot_mapping[:size], "logits_indices": self.logits_indices[:size],
                   "query_start_loc": self.query_start_loc[:size + 1], "seq_lens": self.seq_lens[:size],
                   "context_lens": self.context_lens[:size], "query_lens": self.query_lens[:size],
                   "block_tables": self.block_tables[:size]}
        # Host lengths of the padding shape (one key each); max_seq_len is the limit, so a backend
        # sizes anything it derives from it for every step the graph will replay.
        step = make_step_inputs(tensors, [1] * size, [0] * size, [[0]] * size, size, self.max_model_len,
                                self.block_size)
        if self.local_block_tables is not None:
            step.tensors["w.slot_mapping"] = self.local_slot_mapping[:size]
            step.tensors["w.block_tables"] = self.local_block_tables[:size]
        return step

    def build_metadata(self, step: StepInputs):
        """The step's metadata, and with a local block group the local layers' too (WindowedMetadata)."""
        meta = self.attention.build_packed(step)
        if self.local_block_tables is None:
            return meta
        local = dataclasses.replace(step, slot_mapping=step.tensors["w.slot_mapping"],
                                    block_tables_t=step.tensors["w.block_tables"])
        return WindowedMetadata(meta, self.attention.build_packed(local))

    @torch.inference_mode()
    def capture(self) -> None:
        for size in reversed(self.sizes):  # largest first: the pool is sized once
            self.attention.prepare_graph(size, self.max_model_len)  # outside the capture
            step = self.static_step(size)

            def forward(step=step):
                # The metadata is built inside the capture: whatever it derives on the device from
                # the static buffers is recomputed by every replay.
                meta = self.build_metadata(step)
                logits = self.model(step.input_ids, step.positions, self.kv_caches, meta, step.logits_indices)
                out = self.logits[:step.num_seqs]
                out.copy_(logits)
                return out

            self.graphs[size] = self.capturer.capture(forward)

    def pad_into_static(self, step: StepInputs, size: int) -> None:
        """Copy the step's rows into the static buffers and make rows n..size-1 padding (device ops)."""
        n = step.num_seqs
        width = step.block_tables_t.shape[1]
        self.input_ids[:n].copy_(step.input_ids)
        self.positions[:n].copy_(step.positions)
        self.slot_mapping[:n].copy_(step.slot_mapping)
        self.seq_lens[:n].copy_(step.seq_lens)
        self.context_lens[:n].copy_(step.context_lens_t)
        self.block_tables[:n, :width].copy_(step.block_tables_t)
        if self.local_block_tables is not None:
            self.local_slot_mapping[:n].copy_(step.tensors["w.slot_mapping"])
            self.local_block_tables[:n, :width].copy_(step.tensors["w.block_tables"])
        if size > n:
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(-1)
            if self.local_slot_mapping is not None:
                self.local_slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(1)
            self.context_lens[n:size].zero_()
            # Padding rows read their table's first entry only: whatever is left there is a block id.

    def run(self, step: StepInputs) -> torch.Tensor:
        """Logits (n, V) of a decode-only step of n <= max size rows, by graph replay."""
        n = step.num_seqs
        size = padded_batch_size(n, self.sizes)
        self.pad_into_static(step, size)
        replay, logits = self.graphs[size]
        replay()
        return logits[:n]


def decode_graph_profiler(config: EngineConfig, vocab_size: int, max_model_len: int,
                          make_runner: Callable[[], ModelRunner],
                          run_step: Callable[[ModelRunner], None] | None = None) -> Callable[[], int] | None:
    """plan_gpu_kv_cache's `profile_graphs` (None under enforce_eager: no graphs): the largest decode
    graph's step run eagerly on a one-block runner from `make_runner` (`run_step(runner)` says how: by
    default the runner builds it; a tensor-parallel worker receives it from rank 0, which builds it),
    then the bytes of the graphs' buffers outside their pool."""
    if config.enforce_eager:
        return None
    num_seqs = config.num_cuda_graph_seqs

    def profile_graphs() -> int:
        runner = make_runner()
        if run_step is None:
            runner.profile_decode_graph(num_seqs)
        else:
            run_step(runner)
        torch.cuda.synchronize(config.torch_device)
        return (DecodeGraphs.static_bytes(num_seqs, max_model_len, config.block_size, vocab_size,
                                          runner.windowed is not None)
                + runner.attention.graph_workspace_bytes(graph_batch_sizes(num_seqs), max_model_len))

    return profile_graphs
