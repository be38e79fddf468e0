"""Sequence: one sample of one request, the unit the scheduler and KV cache work on."""

from __future__ import annotations

import enum
import time

from batchgen.engine.sampling.keyed_random import sequence_key
from batchgen.engine.sampling.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


PENDING_TOKEN = -1  # a sampled token still on the device (never a vocabulary id)


class Sequence:
    """Prompt + output token ids, progress (`num_computed_tokens`), block table and timestamps.

    The scheduler only moves `num_computed_tokens` toward `num_tokens`; a preempted sequence
    drops its blocks and recomputes everything it had (prompt and output alike).

    With async scheduling a sampled token is counted before it is read back: `add_pending_token`
    appends a placeholder (PENDING_TOKEN) that `resolve_pending_token` later overwrites, oldest
    first; `num_pending_tokens` of them end `token_ids` at any time (none when steps run in order).
    """

    def __init__(self, request_id: str, sample_index: int, prompt_token_ids: list[int],
                 params: SamplingParams, arrival_time: float, max_total_tokens: int,
                 sample_key: str | None = None):
        self.request_id = request_id
        self.sample_key = request_id if sample_key is None else sample_key  # keys the random draws
        self.sample_index = sample_index
        self.prompt_token_ids = prompt_token_ids
        self.token_ids: list[int] = list(prompt_token_ids)
        self.params = params
        self.num_prompt_tokens = len(prompt_token_ids)
        self.max_total_tokens = max_total_tokens  # max_model_len cap
        self.num_computed_tokens = 0
        self.num_pending_tokens = 0  # trailing placeholders of tokens sampled but not read back
        self.num_cached_tokens: int | None = None  # set at first scheduling
        self.block_ids: list[int] = []
        self.block_hashes: list[tuple] = []  # chained keys of this sequence's full blocks (memo)
        self.num_registered_blocks = 0  # leading blocks already offered to the prefix cache
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.output_logprobs: list[float] = []
        self.output_top_logprobs: list[list[tuple[int, float]]] = []  # (token id, logprob), most likely first
        self.cumulative_logprob = 0.0
        self.output_text: str | None = None  # set when a stop string cut the text
        self.text_state = None  # stop_strings.IncrementalText, made when stop strings are first checked
        self.arrival_time = arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        # Speculative decoding: this step's proposals (verified in the step, then cleared) and the
        # drafts accepted over the sample's life.
        self.draft_token_ids: list[int] = []
        self.num_accepted_tokens = 0
        # Structured output: the sample's place in its grammar (structured/grammar_state.py), advanced
        # with each emitted token; None when unconstrained.
        self.grammar = None
        # Keys every random draw of this sample (with the output position): see keyed_random.py.
        self.random_key = sequence_key(params.seed or 0, self.sample_key, sample_index)
        # Prompt log-probabilities (params.prompt_logprobs, or the continuation of a scored context): one
        # entry per prompt token from token index `prompt_logprobs_start`, filled by the prefill chunks
        # as they run (prompt_logprobs.py); None: not asked. The top N per position when N > 0.
        self.num_prompt_top_logprobs: int | None = params.prompt_logprobs
        self.prompt_logprobs_start = 1
        self.prompt_token_logprobs: list[float] = []
        self.prompt_token_ranks: list[int] = []
        self.prompt_top_logprobs: list[list[tuple[int, float]]] = []
        # A sequence that computes its prompt's KV (and prompt log-probabilities) and samples nothing: the
        # parts of a scored context (score_group.py). The engine ends it when its prompt is computed.
        self.is_prompt_only = False
        # Beam search: the group this beam belongs to (beam_search.py) and, once this beam's next-token
        # distribution is computed, its most likely continuations, waiting for the group's selection.
        self.beam = None
        self.beam_candidates: list[tuple[int, float]] | None = None

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
    def prompt_logprob_position(self) -> int:
        """The first position whose logits still have to give a prompt log-probability (that of the token
        after it); prompt_logprobs.py computes rows while it is below num_prompt_tokens - 1."""
        return self.prompt_logprobs_start - 1 + len(self.prompt_token_logprobs)

    @property
    def num_prompt_logprob_rows(self) -> int:
        """Prompt positions still to compute (0 when none are asked)."""
        if self.num_prompt_top_logprobs is None:
            return 0
        return max(0, self.num_prompt_tokens - 1 - self.prompt_logprob_position)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def fork(self, sample_index: int, token_ids: list[int] | None = None) -> Sequence:
        """A copy of this sequence's tokens and progress under another sample index (no blocks: the KV
        cache manager's `fork` shares them): a beam's sibling, or (with `token_ids`, this sequence's
        tokens followed by more, all prompt) the continuation of a scored context."""
        if token_ids is None:
            child = Sequence(self.request_id, sample_index, self.prompt_token_ids, self.params, self.arrival_time,
                             self.max_total_tokens, self.sample_key)
            child.token_ids = list(self.token_ids)
            child.output_logprobs = list(self.output_logprobs)
            child.cumulative_logprob = self.cumulative_logprob
        else:
            child = Sequence(self.request_id, sample_index, token_ids, self.params, self.arrival_time,
                             self.max_total_tokens, self.sample_key)
        child.num_cached_tokens = self.num_cached_tokens
        child.first_scheduled_time = self.first_scheduled_time
        child.first_token_time, child.last_token_time = self.first_token_time, self.last_token_time
        child.beam = self.beam
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
        self.token_ids.extend(later)
        self.num_pending_tokens = len(later)

    def append_token(self, token_id: int, logprob: float | None,
                     top_logprobs: list[tuple[int, float]] | None = None) -> None:
        now = time.monotonic()
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now
        self.token_ids.append(token_id)
        if logprob is not None:
            self.cumulative_logprob += logprob
            if self.params.logprobs is not None:
                self.output_logprobs.append(logprob)
        if top_logprobs is not None:
            self.output_top_logprobs.append(top_logprobs)
