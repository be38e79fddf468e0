"""Sequence: one sample of one request, the unit the scheduler and KV cache work on."""

from __future__ import annotations

import enum
import time

from batchgen.engine.keyed_random import sequence_key
from batchgen.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Prompt + output token ids, progress (`num_computed_tokens`), block table and timestamps.

    The scheduler only moves `num_computed_tokens` toward `num_tokens`; a preempted sequence
    drops its blocks and recomputes everything it had (prompt and output alike).
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

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

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
