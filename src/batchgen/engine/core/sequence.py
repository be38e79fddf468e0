"""Sequence: one sample of one request, the unit the scheduler and KV cache work on.

Its core state is the tokens, the progress through them, the KV blocks, the status and the sampled
result; each optional feature keeps its state in one slot (None when the sample does not use it):
`text_state` (stop strings, streamed text), `grammar` (structured output), `prompt_logprobs`, `beam`.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from batchgen.engine.sampling.keyed_random import sequence_key
from batchgen.engine.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from batchgen.engine.decoding.beam_search import BeamGroup
    from batchgen.engine.decoding.stop_strings import IncrementalText
    from batchgen.engine.decoding.structured.grammar_state import GrammarState


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


PENDING_TOKEN = -1  # a sampled token still on the device (never a vocabulary id)


@dataclass(slots=True)
class SequenceTimes:
    """Monotonic seconds: see the design's latency definitions (RequestMetrics has the same names)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None


@dataclass(slots=True)
class PromptLogprobState:
    """The prompt log-probabilities a sequence owes (params.prompt_logprobs, or the continuation of a
    scored context): one entry per prompt token from token index `start`, filled by the prefill chunks
    as they run (prompt_logprobs.py), with the `num_top` most likely tokens per position when > 0."""

    num_top: int
    start: int = 1
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # (token id, logprob)

    @property
    def position(self) -> int:
        """The first position whose logits still have to give a prompt log-probability (that of the token
        after it)."""
        return self.start - 1 + len(self.logprobs)


class Sequence:
    """Prompt + output token ids, progress (`num_computed_tokens`), block table, status and result.

    The scheduler only moves `num_computed_tokens` toward `num_tokens`; a preempted sequence
    drops its blocks and recomputes everything it had (prompt and output alike).

    With async scheduling a sampled token is counted before it is read back: `add_pending_token`
    appends a placeholder (PENDING_TOKEN) that `resolve_pending_token` later overwrites, oldest
    first; `num_pending_tokens` of them end `token_ids` at any time (none when steps run in order).
    """

    __slots__ = ("request_id", "sample_key", "sample_index", "params", "random_key",
                 "prompt_token_ids", "token_ids", "num_prompt_tokens", "max_total_tokens", "num_computed_tokens",
                 "num_pending_tokens", "num_cached_tokens", "draft_token_ids", "is_prompt_only",
                 "block_ids", "block_hashes", "num_registered_blocks", "local_block_ids", "num_local_freed",
                 "status", "finish_reason", "stop_reason", "error", "cumulative_logprob", "output_logprobs",
                 "output_top_logprobs", "num_accepted_tokens",
                 "times", "text_state", "grammar", "prompt_logprobs", "beam", "pooled", "lora_int_id")

    def __init__(self, request_id: str, sample_index: int, prompt_token_ids: list[int],
                 params: SamplingParams, arrival_time: float, max_total_tokens: int,
                 sample_key: str | None = None):
        # Which sample of which request; its key for every random draw (with the output position:
        # keyed_random.py).
        self.request_id = request_id
        self.sample_key = request_id if sample_key is None else sample_key
        self.sample_index = sample_index
        self.params = params
        self.random_key = sequence_key(params.seed or 0, self.sample_key, sample_index)
        # Tokens and progress (the scheduler's).
        self.prompt_token_ids = prompt_token_ids
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.max_total_tokens = max_total_tokens  # max_model_len cap
        self.num_computed_tokens = 0
        self.num_pending_tokens = 0  # trailing placeholders of tokens sampled but not read back
        self.num_cached_tokens: int | None = None  # set at first scheduling
        # Speculative decoding: this step's proposals, verified with the sequence's next token (the
        # scheduler's update_from_output keeps those the target agrees with, then clears them).
        self.draft_token_ids: list[int] = []
        # Computes its prompt's KV (and prompt log-probabilities) and samples nothing: the parts of a
        # scored context (score_group.py); the output processor ends it when its prompt is computed.
        self.is_prompt_only = False
        # KV blocks (the KV cache manager's).
        self.block_ids: list[int] = []
        self.block_hashes: list[tuple] = []  # chained keys of this sequence's full blocks (memo)
        self.num_registered_blocks = 0  # leading blocks already offered to the prefix cache
        # A model with sliding-window layers (kv/window_groups.py): their blocks, indexed as block_ids; the
        # first num_local_freed fell out of the window and went back (their entries hold block 0, never read).
        self.local_block_ids: list[int] = []
        self.num_local_freed = 0
        # Status and result.
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.error: str | None = None  # finish_reason "error": why this sample alone failed
        self.cumulative_logprob = 0.0
        self.output_logprobs: list[float] = []
        self.output_top_logprobs: list[list[tuple[int, float]]] = []  # (token id, logprob), most likely first
        self.num_accepted_tokens = 0  # drafts accepted over the sample's life
        self.times = SequenceTimes(arrival_time)
        # Feature slots (None: not used by this sample).
        self.text_state: IncrementalText | None = None  # made by the output processor: stop strings, streams
        self.grammar: GrammarState | None = None  # its place in its grammar, advanced with each token
        self.prompt_logprobs = PromptLogprobState(params.prompt_logprobs) if params.prompt_logprobs is not None \
            else None
        # Beam search: the group this beam belongs to (beam_search.py), which collects its candidates.
        self.beam: BeamGroup | None = None
        # A pooling model's sequence: the score head's logits at its last prompt token, once computed
        # (engine/pooling/pool_rows.py).
        self.pooled: list[float] | None = None
        # The LoRA adapter it runs with (LoRARequest.lora_int_id; 0: the base model).
        self.lora_int_id = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """The output tokens the host has: a pending one (async scheduling) is not among them."""
        return self.token_ids[self.num_prompt_tokens:len(self.token_ids) - self.num_pending_tokens]

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the host has (all but the pending ones)."""
        return len(self.token_ids) - self.num_pending_tokens

    @property
    def is_at_length_limit(self) -> bool:
        """max_tokens or the context limit reached, counting pending tokens: no further step is needed."""
        return self.num_output_tokens >= self.params.max_tokens or self.num_tokens >= self.max_total_tokens

    @property
    def num_top_logprobs(self) -> int:
        """Most likely tokens the sampler reports at this sequence's sampled positions: the request's
        logprobs N, or a beam's candidates per step."""
        return self.beam.num_candidates if self.beam is not None else self.params.num_top_logprobs

    @property
    def can_speculate(self) -> bool:
        """Plain decoding only: a beam's next token is chosen by its group, a prompt-only part has none."""
        return self.beam is None and not self.is_prompt_only

    @property
    def num_prompt_logprob_rows(self) -> int:
        """Prompt positions still to compute (0 when none are asked); prompt_logprobs.py computes rows
        while the state's position is below num_prompt_tokens - 1."""
        state = self.prompt_logprobs
        if state is None:
            return 0
        return max(0, self.num_prompt_tokens - 1 - state.position)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def fork(self, sample_index: int, token_ids: list[int] | None = None) -> Sequence:
        """A copy of this sequence's tokens and progress under another sample index (no blocks: the KV
        cache manager's `fork` shares them): a beam's sibling, or (with `token_ids`, this sequence's
        tokens followed by more, all prompt) the continuation of a scored context."""
        times = self.times
        if token_ids is None:
            child = Sequence(self.request_id, sample_index, self.prompt_token_ids, self.params,
                             times.arrival_time, self.max_total_tokens, self.sample_key)
            child.token_ids = list(self.token_ids)
            child.output_logprobs = list(self.output_logprobs)
            child.cumulative_logprob = self.cumulative_logprob
        else:
            child = Sequence(self.request_id, sample_index, token_ids, self.params, times.arrival_time,
                             self.max_total_tokens, self.sample_key)
        child.num_cached_tokens = self.num_cached_tokens
        child.times = SequenceTimes(times.arrival_time, times.first_scheduled_time, times.first_token_time,
                                    times.last_token_time)
        child.beam = self.beam
        child.lora_int_id = self.lora_int_id
        return child

    def add_pending_token(self) -> None:
        """A token was sampled by a step still on the device: counted now, its id filled in later."""
        self.token_ids.append(PENDING_TOKEN)
        self.num_pending_tokens += 1

    def resolve_pending_token(self, token_id: int, logprob: float | None,
                              top_logprobs: list[tuple[int, float]] | None = None) -> list[int]:
        """The oldest pending token becomes `token_id`; the later placeholders are taken off the end and
        returned (put them back with `restore_pending_tokens`), so the sequence reads as it would have
        after an in-order step: its last token the one just sampled (what the stop checks look at)."""
        num_known = self.num_known_tokens
        later = self.token_ids[num_known + 1:]
        del self.token_ids[num_known:]
        self.num_pending_tokens = 0
        self.append_token(token_id, logprob, top_logprobs)
        return later

    def restore_pending_tokens(self, later: list[int]) -> None:
        """Put back the placeholders of later steps still in flight (async scheduling), taken off by
        `resolve_pending_token` while it wrote the oldest one's token."""
        self.token_ids.extend(later)
        self.num_pending_tokens = len(later)

    def append_token(self, token_id: int, logprob: float | None,
                     top_logprobs: list[tuple[int, float]] | None = None) -> None:
        now = time.monotonic()
        times = self.times
        if times.first_token_time is None:
            times.first_token_time = now
        times.last_token_time = now
        self.token_ids.append(token_id)
        if logprob is not None:
            self.cumulative_logprob += logprob
            if self.params.logprobs is not None:
                self.output_logprobs.append(logprob)
        if top_logprobs is not None:
            self.output_top_logprobs.append(top_logprobs)
