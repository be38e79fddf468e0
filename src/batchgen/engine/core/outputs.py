"""What the engine hands back: vLLM's RequestOutput / CompletionOutput shapes.

`LLMEngine.step()` returns, for each request, what its `SamplingParams.output_kind` asks (vLLM's
RequestOutputKind): FINAL_ONLY (the default here) one RequestOutput when the request finishes;
DELTA one each step the request advanced, holding what is new since its last one (`finished` on the
last; `RequestOutput.add` joins them into the whole output); CUMULATIVE one each step it advanced,
holding everything so far.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import NamedTuple


class RequestOutputKind(enum.Enum):
    """vLLM's: which RequestOutputs `LLMEngine.step()` returns for a request.

    FINAL_ONLY: one, when it finishes (batch jobs, LLM.generate). DELTA: one each step it advanced, its
    CompletionOutputs holding only what is new since the request's previous output (token ids, text,
    logprobs; the samples with nothing new left out; `prompt_logprobs` in the first), `finished` set on
    the last; the text of an unfinished sample is held back while it ends in an incomplete character,
    and by one character less than the longest stop string, so no text sent is cut away later.
    CUMULATIVE: one each step it advanced, every sample's output so far (its text held back likewise).
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


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
    error: str | None = None  # finish_reason "error": why this sample alone failed
    # With a reasoning parser (EngineConfig.reasoning_parser): the thinking (None: the sample did not
    # think), the answer (`text` less the thinking; less the tool calls too where a caller parsed them),
    # and the tokens between the thinking's markers. `text` stays the whole output, as vLLM's.
    reasoning_content: str | None = None
    content: str | None = None
    num_reasoning_tokens: int | None = None
    tool_calls: list | None = None  # ToolCalls (engine/text/tool_parsers.py) where a caller parsed them


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None


@dataclass
class RequestOutput:
    """One request's samples (whole, or what is new: RequestOutputKind); `finished` once it is done."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int
    metrics: RequestMetrics
    finished: bool = True
    prompt: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # SamplingParams.prompt_logprobs not None

    def add(self, delta: RequestOutput) -> RequestOutput:
        """vLLM's `add(next_output, aggregate=True)`: join the request's next DELTA output into this one
        (each sample's token ids, text and logprobs extended; its other fields, the request's metrics
        and `finished` taken from the later one). Returns self: the joined DELTA outputs of a request
        equal its FINAL_ONLY output."""
        self.finished = delta.finished
        self.metrics = delta.metrics
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        by_index = {c.index: c for c in self.outputs}
        for new in delta.outputs:
            old = by_index.get(new.index)
            if old is None:  # its lists copied: the joined output is extended in place, the delta stays as sent
                self.outputs.append(dataclasses.replace(
                    new, token_ids=list(new.token_ids), logprobs=_copy(new.logprobs),
                    top_logprobs=_copy(new.top_logprobs)))
                continue
            old.text += new.text
            if new.reasoning_content is not None:
                old.reasoning_content = (old.reasoning_content or "") + new.reasoning_content
            if new.content is not None:
                old.content = (old.content or "") + new.content
            old.token_ids.extend(new.token_ids)
            if new.logprobs is not None:
                old.logprobs.extend(new.logprobs)
            if new.top_logprobs is not None:
                old.top_logprobs.extend(new.top_logprobs)
            for name in _LATEST_FIELDS:
                setattr(old, name, getattr(new, name))
        self.outputs.sort(key=lambda c: c.index)
        return self


def _copy(values: list | None) -> list | None:
    return None if values is None else list(values)


# A sample's fields that a later DELTA output restates rather than extends.
_LATEST_FIELDS = ("cumulative_logprob", "finish_reason", "stop_reason", "first_scheduled_time",
                  "first_token_time", "last_token_time", "num_accepted_tokens", "score", "num_reasoning_tokens")


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
