"""LLMEngine: add_request / step / has_unfinished, the loop the pipeline drives.

A step, as vLLM v1 splits it: the scheduler picks the chunks (`Scheduler.schedule`), the executor runs
them and samples (a StepResult per sampled row), the scheduler applies the rows to the sequences
(`Scheduler.update_from_output`: tokens, speculative acceptance, grammar acceptance, pending tokens),
and the output processor turns that into outputs (output_processor.py: stop rules, finishing, beams,
scores, detokenizing, RequestOutput / ScoreOutput).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import torch

from batchgen.engine.config import EngineConfig, SettingError
from batchgen.engine.core.output_processor import OutputProcessor, RequestState
from batchgen.engine.core.outputs import RequestOutput, ScoreOutput
from batchgen.engine.core.scheduler import Scheduler, SchedulerOutput
from batchgen.engine.core.sequence import Sequence
from batchgen.engine.decoding.beam_search import BeamGroup
from batchgen.engine.decoding.score_group import ScoreGroup, check_score_request
from batchgen.engine.decoding.speculative import SpecDecoder
from batchgen.engine.decoding.structured.manager import StructuredOutputManager
from batchgen.engine.decoding.thinking_budget import EngineReasoning
from batchgen.engine.kv.capacity import kv_cache_budget_bytes
from batchgen.engine.kv.gpu_memory import GpuMemoryPlan
from batchgen.engine.kv.kv_cache_manager import KVCacheManager
from batchgen.engine.kv.window_groups import model_windowed_kv
from batchgen.engine.loader.model_loader import LoadedModel
from batchgen.engine.lora import LoRAManager, LoRARequest
from batchgen.engine.lora.merge import merged_lora_request, merged_request_id
from batchgen.engine.models.layers.sequence_classifier import pooled_length
from batchgen.engine.models.registry import is_classifier
from batchgen.engine.runner.cpu_allocator import keep_freed_memory
from batchgen.engine.runner.executor import UniprocExecutor, make_executor
from batchgen.engine.runner.model_runner import LaunchedStep, ModelRunner, StepResult
from batchgen.engine.sampling.sampling_params import SamplingParams
from batchgen.engine.text.chat_template import DEFAULT_CHAT, ChatTemplateOptions
from batchgen.engine.text.generation_config import read_generation_defaults
from batchgen.engine.text.tokenizer import Messages, Tokenizer

log = logging.getLogger("batchgen.engine")

PromptInput = str | Messages | list[int]


def needs_tokens_on_host(state: RequestState) -> bool:
    """Whether a request's next step depends on its last step's results on the host, so that steps must
    run in order while it is unfinished: a grammar's next mask on the token just sampled, a beam
    search's next beams on its candidates, a scored context's forks on its end, the next prefill
    chunk's prompt log-probability rows on those recorded."""
    if state.beam is not None or state.score is not None or state.is_pooling:
        return True
    return any(seq.grammar is not None or seq.num_prompt_logprob_rows for seq in state.seqs)


# Settings that shape only the KV pool, the scheduling or the defaults of requests, not the loaded model:
# an engine that differs from another in these alone can share its weights (`weights_from`).
# max_model_len may only shrink.
RUNTIME_SETTINGS = ("block_size", "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching",
                    "kv_cache_memory", "num_kv_blocks", "max_model_len", "kv_cache_dtype", "calculate_kv_scales",
                    "speculative", "generation_config", "seed", "async_scheduling", "reasoning_parser",
                    "tool_call_parser", "enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras")


class LLMEngine:
    """The engine loop (vLLM's names): `add_request` queues a request, `step` schedules, runs the model
    once and hands the step's rows to the scheduler (update_from_output) and the output processor,
    `has_unfinished` says whether to step again. Outputs per request follow its SamplingParams.output_kind."""

    def __init__(self, config: EngineConfig, *, weights_from: LLMEngine | None = None,
                 loaded: LoadedModel | None = None):
        """Load the model named by `config`, or share the loaded weights and tokenizer of `weights_from`
        (an engine whose config differs only in RUNTIME_SETTINGS) with a fresh KV pool, scheduler,
        runner and counters: tests and sweeps of engine settings pay for one load.

        `loaded`: a model built by the caller (the bench's null and random-weight models). Without a
        source it has no tokenizer: prompts are token ids, outputs carry no text, no stop strings."""
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if config.torch_device.type == "cpu":
            keep_freed_memory()
        if config.tensor_parallel_size > 1 and (loaded is not None or weights_from is not None):
            raise ValueError("an engine with tensor_parallel_size > 1 loads its own shards in its worker "
                             "processes: it cannot take a built model (loaded) or share weights (weights_from)")
        # Where the model runs: this process, or tensor-parallel ranks (started now, loading with rank 0).
        self.executor = make_executor(config) if loaded is None and weights_from is None else UniprocExecutor(config)
        try:
            self._start(loaded, weights_from)
        except BaseException:
            self.executor.shutdown()
            raise

    def _start(self, loaded: LoadedModel | None, weights_from: LLMEngine | None) -> None:
        config = self.config
        if loaded is not None:
            tokenizer = Tokenizer(loaded.source) if loaded.source is not None else None
        elif weights_from is None:
            loaded = self.executor.load_model()
            tokenizer = loaded.tokenizer or Tokenizer(loaded.source)
        else:
            _check_shares_weights(weights_from, config)
            loaded, tokenizer = weights_from.loaded, weights_from.tokenizer
        self.loaded = loaded
        self.capabilities = loaded.capabilities  # which kernels run here, decided when the model loaded
        self.model_cfg = loaded.model_cfg
        self.tokenizer = tokenizer
        # A sequence classifier runs as a pooling model (add_pooling_request), a causal LM generates.
        self.is_pooling = is_classifier(self.model_cfg.architecture)
        check_runner(config.runner, self.is_pooling, config.model, self.model_cfg.architecture)
        # The rotary tables cover loaded.max_model_len positions; a sharing engine may use fewer.
        self.max_model_len = min(config.max_model_len or loaded.max_model_len, loaded.max_model_len)
        self.weight_bytes = loaded.weight_bytes
        # Sampling defaults from generation_config.json (engine/text/generation_config.py): read once, here, so
        # a folder without the file fails at start.
        self.generation_defaults = read_generation_defaults(config.generation_config, loaded.source)
        eos = set(self.model_cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(eos))
        # Structured output: constraints compiled at add_request (the grammar library loads at the first).
        self.structured = StructuredOutputManager(
            self.tokenizer.hf if self.tokenizer is not None else None, self.model_cfg.vocab_size,
            self.eos_token_ids, shared=weights_from.structured if weights_from is not None else None)

        device = config.torch_device
        # Per token, in the largest pool (tensor-parallel: each rank's pool holds its KV heads).
        self.kv_bytes_per_token = self.executor.kv_bytes_per_token(loaded)
        self.gpu_memory: GpuMemoryPlan | None = None  # CUDA: how the KV pool was sized
        if config.num_kv_blocks:
            num_blocks = config.num_kv_blocks
        elif device.type == "cuda":
            num_blocks, self.gpu_memory = self.executor.size_kv_pool_on_gpu(loaded, self.eos_token_ids,
                                                                            self.max_model_len)
        else:
            budget = kv_cache_budget_bytes(config, device, self.kv_bytes_per_token, self.max_model_len)
            num_blocks = budget // (self.kv_bytes_per_token * config.block_size)
        if num_blocks * config.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {num_blocks * config.block_size} tokens, fewer than max_model_len "
                f"{self.max_model_len}: raise engine.kv_cache_memory or lower model.max_model_len")
        self.num_kv_blocks = num_blocks
        log.info("weights %.1f MB; KV %d bytes/token x %d tokens (%d blocks of %d) = %.1f MB",
                 self.weight_bytes / 1e6, self.kv_bytes_per_token, num_blocks * config.block_size,
                 num_blocks, config.block_size, self.kv_bytes_per_token * num_blocks * config.block_size / 1e6)
        # Sliding-window layers with their own block group (kv/window_groups.py): the same split the runner makes.
        windowed = model_windowed_kv(config, loaded.model.backend, self.model_cfg.num_layers, num_blocks)
        if windowed is not None:
            log.info("sliding-window layers %s: their own pool of %d blocks; the other layers' pool %d blocks",
                     sorted(windowed.local_layers), windowed.num_local_blocks, windowed.num_blocks)
        self.kv_cache_manager = KVCacheManager(windowed.num_blocks if windowed else num_blocks, config.block_size,
                                               config.enable_prefix_caching, windowed)
        self.scheduler = Scheduler(config, self.kv_cache_manager)
        # LoRA adapters: the targeted projections wrapped before the runner captures any decode graph.
        compute_dtype = getattr(torch, loaded.capabilities.compute_dtype)
        self.lora = None if not config.enable_lora else LoRAManager(
            loaded.model, config.max_loras, config.max_lora_rank, config.num_cpu_loras, compute_dtype, device,
            config.model)
        # merged_lora that could not merge (quantized checkpoint layers) runs unmerged on every request.
        self.merged_lora_id = 0
        if config.merged_lora is not None and loaded.unmerged_lora_rank:
            self.lora = LoRAManager(loaded.model, 1, loaded.unmerged_lora_rank, 1, compute_dtype, device, config.model)
            self.merged_lora_id = self.lora.add(merged_lora_request(config.merged_lora)).lora_int_id
        self.executor.start(loaded, num_blocks, self.eos_token_ids, self.max_model_len)
        self.runner.lora = self.lora
        self.timings = self.runner.timings  # host time per step, by part (bench --workload overhead)
        self.num_generated_tokens = 0  # tokens appended to sequences since start (progress rates)
        # Speculative decoding (off: None). A draft model loads here, after the target's KV pool.
        self.spec = None if config.speculative is None else SpecDecoder(config.speculative, self, LLMEngine)
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids, self.scheduler,
                                                self.kv_cache_manager, self.max_model_len,
                                                _release_callback(self.executor, self.spec),
                                                is_speculative=self.spec is not None)
        self.requests = self.output_processor.requests  # the unfinished requests, by id
        # Reasoning (config.reasoning_parser): outputs split, thinking counted and bounded (thinking_budget.py).
        self.reasoning = EngineReasoning.create(config.reasoning_parser, self.tokenizer)
        self.output_processor.reasoning = self.reasoning
        # Async scheduling: the step launched last, collected by the next call (None: none in flight),
        # and the unfinished requests that need each step's results on the host (steps run in order
        # while there is one: needs_tokens_on_host).
        self.is_async = config.is_async_scheduling
        self.in_flight: LaunchedStep | None = None
        self.in_order_requests: set[str] = set()

    @property
    def runner(self) -> ModelRunner:
        """This process's model runner (tensor-parallel: rank 0's)."""
        return self.executor.runner

    def shutdown(self) -> None:
        """Stop the engine's worker processes (tensor parallelism); the engine cannot step afterwards.
        They also stop when the engine is garbage collected and when the process exits."""
        self.executor.shutdown()

    # ---- requests -------------------------------------------------------------------------------
    def encode(self, prompt: PromptInput, allow_special_tokens: bool = True,
               chat: ChatTemplateOptions = DEFAULT_CHAT) -> list[int]:
        """A string is a raw prompt; a list of messages goes through the chat template (rendered as
        `chat` says); ints pass through.

        `allow_special_tokens=False`: control-token text in a raw prompt or a message ("<|im_start|>")
        is encoded as text, so only the chat template writes control tokens.
        """
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt)):
            return self.tokenizer.encode_prompt(prompt, allow_special_tokens=allow_special_tokens, options=chat)
        raise TypeError("a prompt is a string, a list of chat messages ({role, content}) or a list of token ids")

    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams,
                    prompt_token_ids: list[int] | None = None, sample_key: str | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Queue a request (n sequences). Raises ValueError for an empty or overlong prompt, stop
        token ids outside the vocabulary, or a structured-output constraint that cannot be compiled
        (StructuredOutputError, naming its field).

        Sample i draws from a generator keyed by (params.seed, sample key, i). The sample key is the
        request id unless `sample_key` is given: a job's rows are keyed by their ids, while a caller
        whose request ids are not stable (a server) passes "" for (seed, i) alone or a random key.

        `lora_request`: the LoRA adapter the request runs with (None: the base model); needs
        enable_lora. It is read now: LoRAError (a ValueError) naming the adapter and key when it cannot run.
        """
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        self._check_generates()
        lora_int_id = self.add_lora(lora_request)
        token_ids = prompt_token_ids if prompt_token_ids is not None else self.encode(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len}")
        if any(t >= self.model_cfg.vocab_size for t in params.stop_token_ids):  # an index past the logits
            raise ValueError(f"stop_token_ids {params.stop_token_ids} reach past the vocabulary "
                             f"({self.model_cfg.vocab_size} tokens)")
        self.check_tensor_parallel_support(params)
        grammars = self.structured.new_states(params.structured_outputs, params.n) \
            if params.structured_outputs is not None else None
        is_reasoning_opened = False
        if self.reasoning is not None:
            is_reasoning_opened = self.reasoning.is_opened_by_prompt(token_ids)
            grammars = self.reasoning.gates(params.thinking_token_budget, is_reasoning_opened, grammars, params.n)
        elif params.thinking_token_budget is not None:
            raise SettingError("SamplingParams", "thinking_token_budget", "needs a reasoning parser "
                               "(EngineConfig.reasoning_parser: a job's model.reasoning_parser, the server's "
                               "--reasoning-parser)", params.thinking_token_budget)
        now = time.monotonic()
        # A beam search starts from one sequence (the prompt, computed once); its beams fork from it.
        num_seqs = 1 if params.is_beam_search else params.n
        seqs = [Sequence(request_id, i, token_ids, params, now, self.max_model_len, sample_key)
                for i in range(num_seqs)]
        for seq, grammar in zip(seqs, grammars or ()):
            seq.grammar = grammar
        for seq in seqs[1:]:  # the n samples share one prompt: sample 0 computes its log-probabilities
            seq.prompt_logprobs = None
        for seq in seqs:
            seq.lora_int_id = lora_int_id
        state = RequestState(request_id, token_ids, seqs, now, prompt if isinstance(prompt, str) else None,
                             params.output_kind)
        state.is_reasoning_opened = is_reasoning_opened
        if params.is_beam_search:
            state.beam = BeamGroup(params, self.eos_token_ids, beams=list(seqs))
            seqs[0].beam = state.beam
        self.output_processor.add(state)
        if self.is_async and needs_tokens_on_host(state):
            self.in_order_requests.add(request_id)
        for seq in seqs:
            self.scheduler.add(seq)

    def add_lora(self, lora_request: LoRARequest | None) -> int:
        """Register and read an adapter (vLLM's add_lora); its lora_int_id (0 for None: the base). With
        merged_lora only that adapter (or None) may run (engine/lora/merge.py)."""
        if self.config.merged_lora is not None:
            return merged_request_id(lora_request, self.config.merged_lora, self.merged_lora_id)
        if lora_request is None:
            return 0
        if self.lora is None:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r} asked for, but the engine was started "
                             "without enable_lora (--enable-lora)")
        self.lora.add(lora_request)
        return lora_request.lora_int_id

    def check_tensor_parallel_support(self, params: SamplingParams | None) -> None:
        """ValueError for what tensor parallelism does not run yet: scoring continuations (`params`
        None), beam search (both fork sequences, whose copy on write the worker ranks do not receive)
        and prompt log-probabilities (the vocabulary-parallel head is gathered for sampled rows only)."""
        if self.config.tensor_parallel_size == 1:
            return
        if params is None or params.is_beam_search:
            what = "scoring continuations" if params is None else "beam search (beam_width > 1)"
            raise ValueError(f"{what} is not implemented with tensor_parallel_size > 1")
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not implemented with tensor_parallel_size > 1")

    def compile_grammar(self, constraint):
        """Compile a structured-output constraint (StructuredOutputsParams) now, as add_request would:
        StructuredOutputError naming its field when it cannot be used. The compiled grammar is cached,
        so a request that carries it later starts without compiling."""
        return self.structured.compile(constraint)

    def add_score_request(self, request_id: str, context_token_ids: list[int],
                          continuation_token_ids: list[list[int]], sample_key: str | None = None,
                          lora_request: LoRARequest | None = None) -> None:
        """Queue the scoring of continuations of one context (score_group.py); step() hands back a
        ScoreOutput. Raises ValueError for an empty context or continuation, or one past max_model_len.
        `lora_request`: as in add_request."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        self._check_generates()
        lora_int_id = self.add_lora(lora_request)
        self.check_tensor_parallel_support(None)
        check_score_request(context_token_ids, continuation_token_ids, self.max_model_len,
                            self.model_cfg.vocab_size)
        now = time.monotonic()
        group = ScoreGroup(request_id, list(context_token_ids), [list(c) for c in continuation_token_ids], now)
        seqs = group.first_sequences(self.max_model_len, sample_key)
        for seq in seqs:
            seq.lora_int_id = lora_int_id
        state = RequestState(request_id, group.context_token_ids, seqs, now, None, score=group)
        self.output_processor.add(state)
        if self.is_async:
            self.in_order_requests.add(request_id)
        for seq in state.seqs:
            self.scheduler.add(seq)

    def add_pooling_request(self, request_id: str, prompt_token_ids: list[int]) -> None:
        """Queue a pooling model's request (a sequence classifier's: its prompt prefilled, nothing
        sampled); step() hands back a PoolingRequestOutput whose `outputs.data` is the score head's
        logits (num_labels,) at the last token that is not the config's pad token, as HF's
        `*ForSequenceClassification` pools (the tokens after it are not run). Prompts that share a
        prefix share its KV through the prefix cache when queued one after another.
        ValueError for a model without a classification head, an empty prompt, one past max_model_len or
        a token id outside the vocabulary."""
        if not self.is_pooling:
            raise ValueError(f"{self.config.model} ({self.model_cfg.architecture}) has no classification head: "
                             "pooling requests need a `*ForSequenceClassification` model")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        token_ids = list(prompt_token_ids[:pooled_length(prompt_token_ids, self.model_cfg.pad_token_id)])
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len}")
        if any(t < 0 or t >= self.model_cfg.vocab_size for t in token_ids):
            raise ValueError(f"a token id is outside the vocabulary [0, {self.model_cfg.vocab_size})")
        now = time.monotonic()
        seq = Sequence(request_id, 0, token_ids, _POOLING_PARAMS, now, self.max_model_len)
        seq.is_prompt_only = True
        self.output_processor.add(RequestState(request_id, token_ids, [seq], now, None, is_pooling=True))
        if self.is_async:  # its output is made from the step's results on the host
            self.in_order_requests.add(request_id)
        self.scheduler.add(seq)

    def _check_generates(self) -> None:
        if self.is_pooling:
            raise ValueError(f"{self.config.model} ({self.model_cfg.architecture}) is a pooling model: it scores "
                             "prompts (LLM.classify / reward / encode, task: reward) and generates nothing")

    def abort_request(self, request_id: str) -> bool:
        """Drop an unfinished request: its sequences leave the waiting and running queues and their
        KV blocks go back to the pool (full blocks keep their prefix-cache hashes, as on finishing).
        No output is made. False when the id is not in the engine (finished, aborted or never added)."""
        state = self.output_processor.remove(request_id)
        if state is None:
            return False
        for seq in state.seqs:
            if not seq.is_finished:
                self.scheduler.abort(seq)
            self._release(seq)
        return True

    def sequences(self, request_id: str) -> list[Sequence]:
        """The live sequences of an unfinished request (its n samples, a beam search's beams, a scored
        context's parts), for tests and diagnostics; a stream asks for its outputs instead
        (SamplingParams.output_kind)."""
        return self.requests[request_id].seqs

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.in_flight is not None

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    @property
    def num_unfinished_seqs(self) -> int:
        """Sequences running or waiting for a slot (n per sampled request, a beam search's beams): what
        the batch pipeline's feeder bounds, so that a request's queue time measures the engine."""
        return len(self.scheduler.running) + len(self.scheduler.waiting)

    # ---- the loop -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput | ScoreOutput]:
        """Schedule, run the model once, sample; returns the step's outputs, per request as its
        SamplingParams.output_kind asks (outputs.py RequestOutputKind): FINAL_ONLY (the default) and
        scored contexts its output when it finished in this step; DELTA and CUMULATIVE also one each step
        it advanced (`finished` False until its last). A caller that adds FINAL_ONLY requests only gets
        finished outputs, as before output kinds existed.

        With async scheduling (`EngineConfig.is_async_scheduling`) a call launches the next step, then
        collects the one the previous call launched: the outputs it returns are that step's (one call
        later than in order). While a request needs each step's results on the host
        (needs_tokens_on_host) or the decode graphs wait for their first step, the call collects the
        step in flight and runs an in-order step."""
        if self.is_async:
            return self._step_async()
        return self._step_in_order()

    def _step_in_order(self) -> list[RequestOutput | ScoreOutput]:
        start = time.perf_counter()
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)  # drafts for the sequences about to decode
        out = self.scheduler.schedule()
        scheduled = time.perf_counter()
        if out.is_empty:
            self._check_not_stuck()
            return []
        results = self.executor.execute(out.scheduled, self._num_live_seqs(), out.blocks_to_copy)
        executed = time.perf_counter()
        outputs = self._process(out, results)
        self._count_step(scheduled - start, executed)
        return outputs

    def _step_async(self) -> list[RequestOutput | ScoreOutput]:
        """Schedule and launch step N+1 with step N still on the device (its sampled tokens counted as
        pending: the scheduler needs only how many there are, and N+1 reads their ids on the device),
        then wait for step N alone and process it. The host's schedule and prepare of N+1 overlap N."""
        if self.in_order_requests:  # drop the requests that finished or no longer need it
            self.in_order_requests = {rid for rid in self.in_order_requests
                                      if rid in self.requests and needs_tokens_on_host(self.requests[rid])}
        if self.in_order_requests or self.runner.is_capture_pending:
            outputs: list[RequestOutput | ScoreOutput] = []
            if self.in_flight is not None:
                previous, self.in_flight = self.in_flight, None
                outputs = self._process(None, self.executor.collect(previous))
            return outputs + self._step_in_order()
        start = time.perf_counter()
        out = self.scheduler.schedule()
        scheduled = time.perf_counter()
        launched = None
        if not out.is_empty:
            launched = self.executor.launch(out.scheduled, self._num_live_seqs(), out.blocks_to_copy)
            self.scheduler.update_after_launch(out, launched.sampling)
        elif self.in_flight is None:
            self._check_not_stuck()
            return []
        previous, self.in_flight = self.in_flight, launched
        outputs = []
        collected = time.perf_counter()
        if previous is not None:
            results = self.executor.collect(previous)  # its wait and unpacking are the runner's timings
            collected = time.perf_counter()
            outputs = self._process(None, results)
        self._count_step(scheduled - start, collected)
        return outputs

    def _num_live_seqs(self) -> int:
        """Sequences that may decode soon: the runner sizes its decode staging for them at once."""
        return min(len(self.scheduler.running) + len(self.scheduler.waiting), self.config.max_num_seqs)

    def _check_not_stuck(self) -> None:
        """Nothing could be scheduled and nothing is in flight: requests that wait cannot get blocks, and
        what runs (beams waiting for their group) will not give any back."""
        if self.scheduler.waiting:
            raise RuntimeError("the scheduler cannot admit any waiting request: the KV cache is too small")

    def _count_step(self, schedule_seconds: float, processed_from: float) -> None:
        """The step's host time: scheduling, and processing its results from `processed_from` to now."""
        self.timings.num_steps += 1
        self.timings.add(schedule=schedule_seconds, process=time.perf_counter() - processed_from)

    def _process(self, out: SchedulerOutput | None,
                 results: list[StepResult]) -> list[RequestOutput | ScoreOutput]:
        """A finished step's rows: the scheduler applies them (the output processor's stop rules ending
        samples where they stop), the output processor makes the outputs. `out`: the step when it ran in
        order, None for one launched ahead."""
        update = self.scheduler.update_from_output(out, results, self.output_processor.is_stopped)
        self.num_generated_tokens += update.num_new_tokens
        if update.verifies:
            for num_drafts, num_accepted in update.verifies:
                self.spec.stats.count(num_drafts, num_accepted)
            self.spec.stats.num_spec_steps += 1
        return self.output_processor.process(update)

    def _release(self, seq: Sequence) -> None:
        """What the runner and the draft proposer keep for a finished or aborted sequence goes back."""
        self.output_processor.release(seq)

    # ---- counters -------------------------------------------------------------------------------
    @property
    def stats(self) -> dict:
        """Counters since the engine started, `kernels`: the implementations that run (Capabilities),
        `weights`: the weight format and the decoder's linear bytes (quant/weight_report.py; rank 0's
        shard with tensor parallelism), `speculative`: draft and accepted tokens (speculative/__init__.py
        SpecStats; None when off), `structured`: constrained requests, grammar compiles and the per-step
        mask's counters and host time (structured/manager.py), and `tensor_parallel`: each rank's weight
        bytes, KV bytes per token and peak resident memory (parallel/mp_executor.py; None in one process)."""
        s = self.scheduler.stats
        pool = self.kv_cache_manager.pool
        return {
            "num_steps": s.num_steps, "num_preemptions": s.num_preemptions,
            "num_prefill_tokens": s.num_prefill_tokens, "num_decode_tokens": s.num_decode_tokens,
            "num_mixed_steps": s.num_mixed_steps, "num_partial_prefills": s.num_partial_prefills,
            "num_cached_tokens": s.num_cached_tokens, "num_block_copies": s.num_block_copies,
            "num_evictions": pool.num_evictions, "num_generated_tokens": self.num_generated_tokens,
            "num_free_blocks": pool.num_free_blocks, "num_blocks": pool.num_blocks,
            "prefix_cache_hit_rate": pool.num_hit_blocks / pool.num_queried_blocks if pool.num_queried_blocks else 0.0,
            "kv_cache": {"dtype": str(self.config.kv_torch_dtype).removeprefix("torch."),
                         "bytes_per_token": self.kv_bytes_per_token,
                         "num_tokens": pool.num_blocks * self.config.block_size,
                         "bytes": pool.num_blocks * self.config.block_size * self.kv_bytes_per_token,
                         **self._window_group_report()},
            "kernels": self.capabilities.as_dict(),
            "weights": dict(self.loaded.weights),
            "speculative": self.spec.stats.as_dict() if self.spec is not None else None,
            "structured": self.structured.stats(self.runner.step_bitmask.stats),
            "tensor_parallel": self.executor.report(),
            "lora": self.lora.report() if self.lora is not None else None,
        }


    def _window_group_report(self) -> dict:
        """The sliding-window layers' own block group (kv/window_groups.py), when the pool has one: its
        layers, window and blocks (num_blocks above is then the other layers' pool)."""
        windowed = self.kv_cache_manager.windowed
        if windowed is None:
            return {}
        return {"sliding_window_layers": len(windowed.local_layers), "sliding_window": windowed.window,
                "num_local_blocks": windowed.num_local_blocks,
                "num_free_local_blocks": self.kv_cache_manager.local_pool.num_free_blocks}


# A pooling sequence's parameters: never read (it samples nothing), there because a Sequence has them.
_POOLING_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)


def check_runner(runner: str, is_pooling: bool, model: str, architecture: str | None) -> None:
    """ValueError when the model lacks what `runner` (EngineConfig.runner) runs: pooling needs a
    sequence classifier, generate a causal LM. Names the model and its architecture."""
    if runner == "pooling" and not is_pooling:
        raise ValueError(f"runner pooling needs a sequence classifier (`*ForSequenceClassification`, a score head); "
                         f"{model} is {architecture}, which has no classification head")
    if runner == "generate" and is_pooling:
        raise ValueError(f"runner generate needs a causal LM; {model} is {architecture}, a sequence classifier "
                         "(runner pooling)")


def _check_shares_weights(other: LLMEngine, config: EngineConfig) -> None:
    base = other.config
    differing = [f.name for f in dataclasses.fields(EngineConfig)
                 if f.compare and getattr(base, f.name) != getattr(config, f.name)
                 and f.name not in RUNTIME_SETTINGS]
    if differing:
        raise ValueError(f"an engine sharing loaded weights may change only {', '.join(RUNTIME_SETTINGS)}; "
                         f"got different {', '.join(differing)}")
    if config.max_model_len is not None and config.max_model_len > other.loaded.max_model_len:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the shared model's "
                         f"{other.loaded.max_model_len}")


def _release_callback(executor, spec: SpecDecoder | None) -> Callable[[Sequence], None]:
    """`release(seq)` for the output processor: the runner's (and the draft proposer's) state for a
    finished sequence goes back. Built from the parts rather than bound to the engine, so that the
    engine -> output processor -> engine cycle does not keep a dropped engine's KV pool alive until the
    cycle collector happens to run (seven engines built one after another in one process were killed
    for memory)."""
    if spec is None:
        return executor.release

    def release(seq: Sequence) -> None:
        executor.release(seq)
        spec.release(seq)
    return release
