"""ModelRunner: owns the model and the KV cache; flattens a step into tensors, runs it, samples.

Host<->device traffic happens only here, twice per step: the step's inputs (model, attention and
sampling alike, the block copies of a copy on write, the prompt positions that owe log-probabilities)
go over in one packed copy (step_inputs.py), and the sampled tokens with their log-probabilities (and
top-N log-probabilities where asked), then the prompt log-probabilities, come back in one copy. Nothing
in between reads a device value on the host. A step with a structured-output constraint adds one copy:
its constrained rows' token bitmask, filled on the host while the forward runs (structured/step_bitmask.py)
and applied to the logits before the sampler sees them. On CUDA, decode-only steps replay a captured graph
(decode_graphs.py) unless `enforce_eager`.

With async scheduling the engine runs a step in two halves: `launch` (inputs packed into one of two
host buffers and sent; the forward, the sampler and the read-back queued on the device through
device_stream.py) and, after the next step is launched, `collect` (the wait for its read-back, the
results unpacked). A decode whose previous token is still on the device ("pending") reads it there,
from the previous step's sampled tokens, through one gather after the copy (`FeedSections`), never
through the host. Only plain steps launch ahead (no constrained row, prompt log-probability row or
verify chunk: those need each step's results on the host first); `execute` is the in-order step.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from batchgen.engine.attention import allocate_kv_caches, copy_blocks
from batchgen.engine.attention.base import WindowedMetadata
from batchgen.engine.capabilities import Capabilities
from batchgen.engine.config import EngineConfig
from batchgen.engine.core.scheduler import ScheduledSeq
from batchgen.engine.core.sequence import Sequence
from batchgen.engine.decoding.prompt_logprobs import (
    add_prompt_logprob_sections,
    compute_prompt_logprobs,
    record_prompt_logprobs,
)
from batchgen.engine.decoding.structured.step_bitmask import StepBitmask
from batchgen.engine.kv.window_groups import WindowedKV, model_windowed_kv
from batchgen.engine.models.config import ModelConfig
from batchgen.engine.models.layers.causal_lm import CausalLM
from batchgen.engine.pooling.pool_rows import add_pool_sections, record_pooled
from batchgen.engine.runner.decode_graphs import DecodeGraphs
from batchgen.engine.runner.device_stream import ImmediateStream
from batchgen.engine.runner.step_inputs import (
    BlockCopySections,
    StepInputs,
    StepPacker,
    add_local_table_sections,
    add_step_sections,
    int_section,
    make_step_inputs,
)
from batchgen.engine.runner.step_timings import StepTimings
from batchgen.engine.sampling.sampler import SampledTokens, Sampler
from batchgen.engine.sampling.sampling_batch import (
    PenaltyState,
    add_sampling_sections,
    attach_sampling_tensors,
)


class StepResult(NamedTuple):
    """One sampled row of a step. A verify chunk (speculative decoding) gives 1 + k consecutive rows for
    its sequence, in position order."""

    scheduled: ScheduledSeq
    token_id: int
    logprob: float  # raw: the model's log-probability of the token, before penalties and filters
    top_logprobs: list[tuple[int, float]] | None  # (token id, raw logprob), most likely first; None: not asked


# StepResult from a tuple in C: a NamedTuple's own constructor is a Python call, 4x the cost per row.
_make_step_result = functools.partial(tuple.__new__, StepResult)


@dataclass
class FeedSections:
    """Decode rows whose input token is the previous step's sampled token, still on the device."""

    feed_rows: list[int] = int_section()  # rows of input_ids
    feed_sources: list[int] = int_section()  # rows of the previous step's sampled tokens


@dataclass
class LaunchedStep:
    """A step queued on the device: what `collect` needs to read and unpack its results."""

    sampling: list[ScheduledSeq]
    top_counts: list[int]
    read_back: Future | None = None  # -> a HostResult (None: the step samples nothing)
    rows: dict[int, int] = field(default_factory=dict)  # id(sequence) -> its row of the sampled tokens
    # Written by the step's device work and read only by later device work (the stream runs in order):
    # "tokens", (N,) the sampled tokens on the device, which the next step's pending decodes read.
    device_outputs: dict = field(default_factory=dict)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, model: CausalLM,
                 num_blocks: int, eos_token_ids: tuple[int, ...], capabilities: Capabilities):
        self.config = config
        self.model_cfg = model_cfg
        self.model = model
        self.device = config.torch_device
        self.block_size = config.block_size
        self.eos_token_ids = eos_token_ids
        self.sampler = Sampler(eos_token_ids, is_c_sampling=capabilities.is_c_sampling)
        # Sliding-window layers with their own, smaller block group (kv/window_groups.py; None: one group):
        # the split of `num_blocks` full-model blocks the engine's KV cache manager makes too.
        self.windowed: WindowedKV | None = model_windowed_kv(config, model.backend, model_cfg.num_layers, num_blocks)
        if self.windowed is not None:
            num_blocks = self.windowed.num_blocks
        num_slots = num_blocks * config.block_size
        # Per layer: K and V caches as (num_slots, kv_heads, head_dim); slot = block * block_size + offset.
        # In engine.kv_cache_dtype (FP8: with per-layer scales, from the checkpoint or calibrated). The
        # KV heads are the attention backend's: a tensor-parallel rank's pool holds its heads only.
        if config.kv_torch_dtype != config.torch_dtype and not model.backend.supports_fp8_kv:
            raise ValueError(f"engine.kv_cache_dtype {config.kv_cache_dtype} needs attention_backend cpu or triton; "
                             f"this model attends through {model.backend.name}")
        self.kv_caches = allocate_kv_caches(
            model_cfg.num_layers, num_slots, model.backend.num_kv_heads, model_cfg.head_dim, config.kv_torch_dtype,
            self.device, checkpoint_scales=getattr(model, "kv_cache_scales", None),
            calculate_scales=config.calculate_kv_scales,
            local_layers=self.windowed.local_layers if self.windowed else frozenset(),
            num_local_slots=self.windowed.num_local_blocks * config.block_size if self.windowed else 0)
        # This engine's half of the model's attention backend (its per-step metadata, any state it
        # keeps across steps); the model's layers call the backend itself.
        self.attention = model.backend.make_metadata_builder(model_cfg.num_layers, num_slots, config.block_size,
                                                             config.torch_dtype, self.device)
        self.packer = StepPacker(self.device)
        # Async scheduling: steps launched ahead are packed into two host buffers in turn (a step is
        # packed while the one before may still be copied or, on the CPU, read), `packer` and a second
        # one made at the first launch; `packer` is the one used last, which an in-order step reuses
        # (nothing is in flight then). Their device work goes through `stream` (device_stream.py; the
        # overhead bench puts a stand-in GPU there).
        self.packers: tuple[StepPacker, StepPacker] | None = None
        self.stream = ImmediateStream()
        self.last_launched: LaunchedStep | None = None  # whose sampled tokens a pending decode reads
        self.penalties = PenaltyState(model_cfg.vocab_size, self.device)
        self.step_bitmask = StepBitmask(model_cfg.vocab_size, self.device)
        self.graphs: DecodeGraphs | None = None  # set by capture_decode_graphs (CUDA, not enforce_eager)
        self._pending_capture: tuple | None = None  # a capture waiting for the FP8 KV scales' calibration
        self.timings = StepTimings()
        # Tensor parallelism: rank 0's executor sends each packed step to the workers here, before
        # the forward (engine/parallel/mp_executor.py); None: one process.
        self.step_sink = None
        # A pooling model (a sequence classifier): its steps keep the score head's logits of the pooled
        # rows (pooling/pool_rows.py), never sample. `pool_seqs`: the prepared step's pooled sequences.
        self.is_pooling = getattr(model, "is_pooling", False)
        self.pool_seqs = None
        # LoRA adapters (enable_lora): the engine's LoRAManager (engine/lora/manager.py), set by the engine.
        self.lora = None

    def release(self, seq: Sequence) -> None:
        """`seq` finished or was aborted: give back what the runner keeps for it (its penalty row)."""
        self.penalties.release(seq)

    def capture_decode_graphs(self, max_model_len: int, capturer=None) -> None:
        """Capture the decode forward at every graph batch size (decode_graphs.py). With FP8 KV scales
        still to calibrate (calculate_kv_scales), the capture waits for the first real step: its warm-up
        runs padding rows (token 0 at position 0), whose keys and values would set the scales."""
        self._pending_capture = (max_model_len, capturer)
        if not any(cache.needs_scales for cache in self.kv_caches):
            self._capture_pending()

    def capture_if_pending(self) -> None:
        """After a step: the capture that waited for the FP8 KV scales runs now (the step calibrated
        them). Every tensor-parallel rank calls this after the same step, so their captures, which run
        the collectives, stay in lockstep."""
        if self._pending_capture is not None:
            self._capture_pending()

    def _capture_pending(self) -> None:
        max_model_len, capturer = self._pending_capture
        self._pending_capture = None
        is_cuda = self.device.type == "cuda"
        reserved = torch.cuda.memory_reserved(self.device) if is_cuda else 0
        start = time.perf_counter()
        self.graphs = DecodeGraphs(self.model, self.kv_caches, self.attention, self.config.num_cuda_graph_seqs,
                                   max_model_len, self.block_size, self.device, capturer,
                                   has_local_tables=self.windowed is not None)
        self.graphs.capture()
        self.graphs.capture_seconds = time.perf_counter() - start
        # What the graphs hold: their pool and the buffers they read (CUDA; 0 for a stand-in capture).
        self.graphs.memory_bytes = torch.cuda.memory_reserved(self.device) - reserved if is_cuda else 0

    @property
    def is_capture_pending(self) -> bool:
        """The decode graphs wait for the first real step (FP8 KV scales to calibrate)."""
        return self._pending_capture is not None

    def prepare(self, scheduled: list[ScheduledSeq], num_live_seqs: int = 0,
                blocks_to_copy: list[tuple[int, int]] | None = None, feed_from: LaunchedStep | None = None):
        """The step's inputs on the device in one copy: (StepInputs, attention metadata, sampling
        chunks, SamplingBatch, PromptLogprobPlan or None). Verify chunks (drafts) run as prefill chunks
        over their cached context; `blocks_to_copy` (source, destination) go in the same copy.
        Packs into `self.packer` (`launch` switches it first); `feed_from`: the step launched before this
        one, whose sampled tokens the pending decodes read (FeedSections)."""
        # Decodes first, in the order the attention backend asks for, then prefill chunks.
        decodes = [s for s in scheduled if s.num_new_tokens == 1]
        decode_seqs = [s.seq for s in decodes]
        ordered = self.attention.reorder_decodes(decode_seqs, num_live_seqs)
        if ordered is not decode_seqs:  # the backend chose another order
            by_seq = {id(s.seq): s for s in decodes}
            decodes = [by_seq[id(seq)] for seq in ordered]
        # Chunks that continue a cached context first, similar lengths side by side (attended in
        # padded groups where the backend gathers keys, so neighbours pad little); fresh prompts last.
        prefills = []
        if len(decodes) < len(scheduled):
            prefills = sorted((s for s in scheduled if s.num_new_tokens != 1),
                              key=lambda s: (s.seq.num_computed_tokens == 0, s.num_new_tokens,
                                             s.seq.num_computed_tokens))
        packer = self.packer
        query_lens, context_lens, tables, max_seq_len, sampling = add_step_sections(
            packer, decodes + prefills, len(decodes), self.block_size)
        local_tables = None
        if self.windowed is not None:
            local_tables = add_local_table_sections(packer, decodes + prefills, self.block_size,
                                                    max(map(len, tables), default=0))
        seqs, offsets = sampling_rows(sampling)
        batch = add_sampling_sections(packer, seqs, self.eos_token_ids, self.model_cfg.vocab_size, self.penalties,
                                      offsets)
        prompt_plan = add_prompt_logprob_sections(packer, decodes + prefills, query_lens)
        if self.is_pooling:
            self.pool_seqs = add_pool_sections(packer, decodes + prefills, query_lens)
        if blocks_to_copy:
            packer.add_sections(BlockCopySections([s for s, _ in blocks_to_copy], [d for _, d in blocks_to_copy]),
                                "c.")
        if feed_from is not None:
            feed = feed_sections(decodes, feed_from.rows)
            if feed.feed_rows:
                packer.add_sections(feed, "f.")
        if self.lora is not None:  # each token's adapter slot, grouped by slot
            self.lora.add_step_sections(packer, [s.seq.lora_int_id for s in decodes + prefills], query_lens)
        tensors = packer.send()  # the one host-to-device copy
        step = make_step_inputs(tensors, query_lens, context_lens, tables, len(decodes), max_seq_len, self.block_size)
        if self.lora is not None:
            step.lora = self.lora.mapping(tensors)
        attach_sampling_tensors(batch, tensors)
        if self.step_sink is not None:
            self.step_sink(step, packer.sent)
        return step, self.attention_metadata(step, local_tables), sampling, batch, prompt_plan

    def attention_metadata(self, step: StepInputs, local_tables: list[list[int]] | None = None):
        """The step's attention metadata; with a local block group (its packed "w." sections in step.tensors)
        the local layers' too, the same step over their slots and tables (WindowedMetadata)."""
        meta = self.attention.build_packed(step)
        if self.windowed is None:
            return meta
        return WindowedMetadata(meta, self.attention.build_packed(dataclasses.replace(
            step, slot_mapping=step.tensors["w.slot_mapping"], block_tables=local_tables or [],
            block_tables_t=step.tensors["w.block_tables"])))

    def _copy_blocks(self, step: StepInputs) -> None:
        """The step's copies on write, before its forward; with a local block group, the ids from
        pool.num_blocks on are its blocks (KVCacheManager.take_copies) and copy in the local layers only."""
        src, dst = step.tensors["c.copy_src"], step.tensors["c.copy_dst"]
        if self.windowed is None:
            copy_blocks(self.kv_caches, src, dst, self.block_size)
            return
        local, offset = self.windowed.local_layers, self.windowed.num_blocks
        is_local = src >= offset
        copy_blocks([c for i, c in enumerate(self.kv_caches) if i not in local], src[~is_local], dst[~is_local],
                    self.block_size)
        copy_blocks([c for i, c in enumerate(self.kv_caches) if i in local], src[is_local] - offset,
                    dst[is_local] - offset, self.block_size)

    def forward(self, step: StepInputs, meta) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits (N, V) float32 of the step's sampling rows: a graph replay for a decode-only step
        of a captured size, else the eager model; with prompt log-probability rows, also their normed
        hidden states (R, H) (eager)."""
        pool_rows = step.tensors.get("q.pool_rows")
        if pool_rows is not None:  # a pooling model's: the score head's logits (R, num_labels) of those rows
            return self.model(step.input_ids, step.positions, self.kv_caches, meta, pool_rows)
        if step.lora is not None:  # the LoRA layers read the step's adapter segments (eager: graphs hold none)
            self.lora.state.mapping = step.lora
            try:
                return self._forward_eager(step, meta)
            finally:
                self.lora.state.mapping = None
        if self.graphs is not None and step.is_decode_only and self.graphs.fits(step.num_seqs) \
                and "p.prompt_rows" not in step.tensors:
            return self.graphs.run(step)
        return self._forward_eager(step, meta)

    def _forward_eager(self, step: StepInputs, meta) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        prompt_rows = step.tensors.get("p.prompt_rows")
        if prompt_rows is not None:
            return self.model(step.input_ids, step.positions, self.kv_caches, meta, step.logits_indices, prompt_rows)
        return self.model(step.input_ids, step.positions, self.kv_caches, meta, step.logits_indices)

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq], num_live_seqs: int = 0,
                blocks_to_copy: list[tuple[int, int]] | None = None) -> list[StepResult]:
        """Run one step; returns a StepResult for each sampled row: one per sampling sequence, 1 + k in
        position order for a verify chunk (each sampled as plain decoding would there; the scheduler's
        update_from_output keeps the accepted prefix). Prompt
        log-probabilities are recorded into their sequences (prompt_logprobs.py).
        `num_live_seqs`: unfinished sequences that may decode soon (the backend may plan for them);
        `blocks_to_copy`: (source, destination) blocks copied before the forward (copy on write)."""
        timings = self.timings
        start = time.perf_counter()
        step, meta, sampling, batch, prompt_plan = self.prepare(scheduled, num_live_seqs, blocks_to_copy)
        prepared = time.perf_counter()
        if blocks_to_copy:
            self._copy_blocks(step)
        logits = self.forward(step, meta)  # (N, V), or with prompt rows ((N, V), (R, H))
        if self.pool_seqs is not None:  # (R, num_labels): no sampling rows in a pooling model's step
            record_pooled(logits.cpu().numpy(), self.pool_seqs)
            self.pool_seqs = None
            timings.add(prepare=prepared - start, forward=time.perf_counter() - prepared)
            return []
        prompt_values = None
        if prompt_plan is not None:
            logits, hidden = logits
            prompt_values = compute_prompt_logprobs(self.model.vocab_logits, hidden, step.tensors["p.prompt_targets"],
                                                    prompt_plan.num_top)
        if not sampling and prompt_plan is None:
            timings.add(prepare=prepared - start, forward=time.perf_counter() - prepared)
            self.capture_if_pending()
            return []
        seqs, _ = sampling_rows(sampling)
        if sampling and batch.grammar_fills:  # constrained rows: masked before penalties, temperature, top-k/p
            self.step_bitmask.apply(logits, batch.grammar_fills, batch.grammar_rows)
        sampled = self.sampler.sample(logits, batch, seqs, self.penalties) if sampling else None
        host, prompt_host = read_back(sampled, prompt_values)  # the one device-to-host copy; waits for the step
        done = time.perf_counter()
        if prompt_plan is not None:
            record_prompt_logprobs(prompt_host, prompt_plan)
        results = unpack_results(host, sampling, batch.top_counts) if sampling else []
        timings.add(prepare=prepared - start, forward=done - prepared, process=time.perf_counter() - done)
        self.capture_if_pending()  # after the step that calibrated the FP8 KV scales
        return results

    @torch.inference_mode()
    def launch(self, scheduled: list[ScheduledSeq], num_live_seqs: int = 0,
               blocks_to_copy: list[tuple[int, int]] | None = None) -> LaunchedStep:
        """Pack and send a plain step's inputs (into the host buffer the last launch did not use), then
        queue its forward, sampler and read-back on the device (`stream`) without waiting for them. A
        decode with a pending token reads it from the last launched step's sampled tokens on the device.
        RuntimeError for what needs the host between steps (a constrained row, prompt log-probability
        rows, a verify chunk): the engine runs those in order."""
        timings = self.timings
        start = time.perf_counter()
        previous = self.last_launched
        if self.packers is None:
            self.packers = (self.packer, StepPacker(self.device))
        self.packer = self.packers[1] if self.packer is self.packers[0] else self.packers[0]
        step, meta, sampling, batch, prompt_plan = self.prepare(scheduled, num_live_seqs, blocks_to_copy, previous)
        if batch.grammar_fills or prompt_plan is not None or any(s.num_draft_tokens for s in sampling):
            raise RuntimeError("a step with structured-output rows, prompt log-probabilities or drafts "
                               "cannot be launched ahead: run it in order (ModelRunner.execute)")
        prepared = time.perf_counter()
        seqs = [s.seq for s in sampling]
        launched = LaunchedStep(sampling, batch.top_counts)
        outputs = launched.device_outputs

        @torch.inference_mode()  # thread-local: the work may run on a stream's own thread
        def device_work() -> HostResult | None:
            if blocks_to_copy:
                self._copy_blocks(step)
            self._feed(step, previous)
            logits = self.forward(step, meta)  # (N, V)
            if not sampling:
                return None
            sampled = self.sampler.sample(logits, batch, seqs, self.penalties)
            outputs["tokens"] = sampled.tokens
            return HostResult(sampled)  # the one device-to-host copy, queued

        launched.read_back = self.stream.submit(device_work)
        if sampling:
            launched.rows = {id(seq): row for row, seq in enumerate(seqs)}
            self.last_launched = launched
        timings.add(prepare=prepared - start, forward=time.perf_counter() - prepared)
        return launched

    def _feed(self, step: StepInputs, previous: LaunchedStep | None) -> None:
        """Device op: the pending decodes' input tokens from the previous step's sampled tokens."""
        rows = step.tensors.get("f.feed_rows")
        if rows is not None:
            sources = step.tensors["f.feed_sources"].long()
            tokens = previous.device_outputs["tokens"].index_select(0, sources)
            step.input_ids.index_copy_(0, rows.long(), tokens.to(torch.int32))

    def collect(self, launched: LaunchedStep) -> list[StepResult]:
        """Wait for a launched step's read-back and unpack it (the results as `execute` returns them)."""
        start = time.perf_counter()
        pending = launched.read_back.result()
        host = None if pending is None else pending.wait()  # the step (and those queued before it) done
        waited = time.perf_counter()
        results = [] if host is None else unpack_results(host, launched.sampling, launched.top_counts)
        self.timings.add(forward=waited - start, process=time.perf_counter() - waited)
        if launched is self.last_launched:
            self.last_launched = None  # nothing left in flight: no later step reads its tokens
        return results

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, num_seqs: int, max_model_len: int) -> None:
        """One step at its largest (num_tokens new tokens over num_seqs sampling prompts, random
        sampling with top-p) and the sampler over `num_seqs` rows, for measuring peak memory.

        Every token's KV goes to block 0 (the values are never read back), so the pool may hold one block.
        """
        from batchgen.engine.sampling.sampling_params import SamplingParams

        num_seqs = max(1, min(num_seqs, num_tokens))
        num_seqs = max(num_seqs, -(-num_tokens // max(max_model_len - 1, 1)))
        params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=1)
        scheduled = []
        for i in range(num_seqs):
            n = num_tokens // num_seqs + (i < num_tokens % num_seqs)
            seq = Sequence(f"profile-{i}", 0, [0] * n, params, 0.0, n + 1)
            seq.block_ids = [0] * (-(-n // self.block_size))
            seq.local_block_ids = list(seq.block_ids)
            scheduled.append(ScheduledSeq(seq, n))
        step, meta, sampling, batch, _ = self.prepare(scheduled)
        logits = self.model(step.input_ids, step.positions, self.kv_caches, meta, step.logits_indices)
        if self.is_pooling:  # the forward with every row pooled is the step at its largest; nothing samples
            logits.cpu()
            return
        read_back(self.sampler.sample(logits, batch, [s.seq for s in sampling], self.penalties))

    @torch.inference_mode()
    def profile_decode_graph(self, num_seqs: int) -> None:
        """The largest decode graph's forward, run eagerly (its allocations are what the graphs' pool
        will hold): `num_seqs` sequences of one new token over one cached token, KV in block 0."""
        from batchgen.engine.sampling.sampling_params import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=1)
        scheduled = []
        for i in range(num_seqs):
            seq = Sequence(f"profile-graph-{i}", 0, [0, 0], params, 0.0, 3)
            seq.num_computed_tokens = 1
            seq.block_ids = [0]
            seq.local_block_ids = [0]
            scheduled.append(ScheduledSeq(seq, 1))
        step, meta, _, _, _ = self.prepare(scheduled)
        self.model(step.input_ids, step.positions, self.kv_caches, meta, step.logits_indices)


def sampling_rows(sampling: list[ScheduledSeq]) -> tuple[list[Sequence], list[int] | None]:
    """Each logits row's sequence and draft offset (None: no verify chunk, every offset 0)."""
    if all(not s.num_draft_tokens for s in sampling):
        return [s.seq for s in sampling], None
    seqs, offsets = [], []
    for s in sampling:
        seqs.extend([s.seq] * s.num_sampled)
        offsets.extend(range(s.num_sampled))
    return seqs, offsets


def feed_sections(decodes: list[ScheduledSeq], rows: dict[int, int]) -> FeedSections:
    """The decodes whose input token (pending: sampled by the step launched before, not yet read back)
    comes from that step's sampled tokens on the device (`rows`: id(sequence) -> its row there)."""
    feed = FeedSections()
    for row, s in enumerate(decodes):
        if s.seq.num_pending_tokens:
            feed.feed_rows.append(row)
            feed.feed_sources.append(rows[id(s.seq)])
    return feed


def sampled_columns(sampled: SampledTokens) -> torch.Tensor:
    """(N, 2 + 2K) int32 on the device: token, logprob bits, K top ids, K top logprob bits."""
    columns = [sampled.tokens.to(torch.int32)[:, None], sampled.logprobs.view(torch.int32)[:, None]]
    if sampled.top_ids is not None:
        columns += [sampled.top_ids.to(torch.int32), sampled.top_logprobs.contiguous().view(torch.int32)]
    return torch.cat(columns, dim=1)


class HostResult:
    """A launched step's read-back, queued on the device: on CUDA a non-blocking copy into pinned memory
    and the event after it, waited for only when the results are needed; on the CPU the array itself."""

    def __init__(self, sampled: SampledTokens):
        columns = sampled_columns(sampled)  # (N, 2 + 2K)
        self.event = None
        if columns.device.type == "cpu":
            self.host = columns
        elif columns.is_cuda:
            self.host = torch.empty(columns.shape, dtype=torch.int32, pin_memory=True)
            self.host.copy_(columns, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:  # another device (the tests' meta stand-in): a plain copy
            self.host = columns.cpu()

    def wait(self) -> np.ndarray:
        if self.event is not None:
            self.event.synchronize()
        return self.host.numpy()


def read_back(sampled: SampledTokens | None, prompt_values: torch.Tensor | None = None
              ) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The step's results on the host in one copy: the sampled rows (N, 2 + 2K) int32 (token, logprob
    bits, K top ids, K top logprob bits) and the prompt log-probability rows (R, 2 + 2K') int32
    (compute_prompt_logprobs), each None when the step has none."""
    parts, shapes = [], []
    if sampled is not None:
        rows = sampled_columns(sampled)
        parts.append(rows.reshape(-1))
        shapes.append(rows.shape)
    if prompt_values is not None:
        parts.append(prompt_values.reshape(-1))
        shapes.append(prompt_values.shape)
    host = (parts[0] if len(parts) == 1 else torch.cat(parts)).cpu().numpy()
    out, offset = [], 0
    for rows, cols in shapes:
        out.append(host[offset:offset + rows * cols].reshape(rows, cols))
        offset += rows * cols
    if sampled is None:
        out.insert(0, None)
    if prompt_values is None:
        out.append(None)
    return out[0], out[1]


def unpack_results(host: np.ndarray, sampling: list[ScheduledSeq], top_counts: list[int]) -> list[StepResult]:
    if any(s.num_draft_tokens for s in sampling):  # a verify chunk's rows share its ScheduledSeq
        sampling = [s for s in sampling for _ in range(s.num_sampled)]
    floats = host.view(np.float32)
    tokens = host[:, 0].tolist()
    logprobs = floats[:, 1].tolist()
    tops: list[list[tuple[int, float]] | None] = [None] * len(sampling)
    if host.shape[1] > 2:
        k = (host.shape[1] - 2) // 2
        for row, n in enumerate(top_counts):
            if n:
                tops[row] = list(zip(host[row, 2:2 + n].tolist(), floats[row, 2 + k:2 + k + n].tolist()))
    return list(map(_make_step_result, zip(sampling, tokens, logprobs, tops)))
