"""What the engine hands back: vLLM's RequestOutput / CompletionOutput shapes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class TopLogprob(NamedTuple):
    """One of a position's most likely tokens: its id, its text decoded alone, its raw log-probability."""

    token_id: int
    token: str
    logprob: float


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
