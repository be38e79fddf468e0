"""What the engine hands back: vLLM's RequestOutput / CompletionOutput shapes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class TopLogprob(NamedTuple):
    """One of a position's most likely tokens: its id, its text decoded alone, its raw log-probability."""

    token_id: int
    token: str
    logprob: float


class Logprob(NamedTuple):
    """vLLM's: a token's raw log-probability at one position, its rank there (1: the most likely) and its
    text decoded alone."""

    logprob: float
    rank: int
    decoded_token: str


# vLLM's prompt_logprobs: None for the first prompt token, then per position {token id: Logprob}, the
# prompt's own token first, then the top N (a prompt token among the top N appears once).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One sample. Times are monotonic seconds; see the design's latency definitions."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[float] | None  # the chosen tokens' (SamplingParams.logprobs not None)
    finish_reason: str | None  # stop | length | error
    stop_reason: str | int | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    top_logprobs: list[list[TopLogprob]] | None = None  # per token, most likely first (logprobs = N > 0)
    num_accepted_tokens: int | None = None  # draft tokens accepted (speculative decoding; None when off)
    score: float | None = None  # beam search: the length-penalised score the beams are ranked by


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int
    metrics: RequestMetrics
    finished: bool = True
    prompt: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # SamplingParams.prompt_logprobs not None


@dataclass
class ContinuationScore:
    """One continuation of a scored context: each of its tokens' raw log-probability given the context and
    the continuation tokens before it, and its rank there (1: the most likely token)."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def sum_logprob(self) -> float:
        """lm-evaluation-harness' loglikelihood: the log-probability of the whole continuation."""
        return float(sum(self.logprobs))

    @property
    def is_greedy(self) -> bool:
        """lm-evaluation-harness' is_greedy: every continuation token is the most likely one where it stands."""
        return all(rank == 1 for rank in self.ranks)


@dataclass
class ScoreOutput:
    """A scored context (LLMEngine.add_score_request): its continuations in the order given."""

    request_id: str
    prompt_token_ids: list[int]  # the context's
    continuations: list[ContinuationScore]
    num_cached_tokens: int  # context tokens taken from the prefix cache
    metrics: RequestMetrics
    finished: bool = True
