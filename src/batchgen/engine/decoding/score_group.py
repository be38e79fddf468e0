"""Scoring given continuations of one context (lm-evaluation-harness' loglikelihood requests).

The context is computed once. A prompt-only sequence runs the context but its last token; when its KV
is in the cache, each continuation becomes a prompt-only fork holding those blocks, the last partial one
included (copied when the fork first writes into it, kv_cache_manager.py), whose prompt is the context
then the continuation. A fork computes the context's last token and its continuation, and the logits of
those positions give each continuation token's log-probability and rank (prompt_logprobs.py). So k
continuations cost one context prefill plus k x (1 + continuation length) tokens.

Tokenization follows lm-evaluation-harness (`TemplateLM._encode_pair`): trailing spaces of the context
move to the continuation, context + continuation is encoded as one text and split after the context's
own token count, so the continuation's first token is the one the joint text has there.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from batchgen.engine.core.outputs import ContinuationScore, RequestMetrics, ScoreOutput
from batchgen.engine.core.sequence import PromptLogprobState, Sequence
from batchgen.engine.sampling.sampling_params import SamplingParams


def encode_continuations(encode: Callable[[str], list[int]], context: str, continuations: list[str]
                         ) -> tuple[list[int], list[list[int]]]:
    """(context token ids, each continuation's token ids) as lm-evaluation-harness splits them; `encode`
    maps text to token ids (the same call for the context alone and for context + continuation)."""
    num_spaces = len(context) - len(context.rstrip())
    moved = context[len(context) - num_spaces:] if num_spaces else ""
    context = context[:len(context) - num_spaces]
    context_ids = encode(context)
    return context_ids, [encode(context + moved + c)[len(context_ids):] for c in continuations]


def check_score_request(context_token_ids: list[int], continuation_token_ids: list[list[int]], max_model_len: int,
                        vocab_size: int) -> None:
    """ValueError for an empty context or continuation, one past max_model_len, or a token id outside the
    vocabulary."""
    if not context_token_ids:
        raise ValueError("the context is empty")
    if not continuation_token_ids:
        raise ValueError("there are no continuations to score")
    for i, ids in enumerate(continuation_token_ids):
        if not ids:
            raise ValueError(f"continuation {i} is empty (no token after the context)")
        if len(context_token_ids) + len(ids) > max_model_len:
            raise ValueError(f"the context ({len(context_token_ids)} tokens) and continuation {i} "
                             f"({len(ids)}) exceed max_model_len {max_model_len}")
    if any(t < 0 or t >= vocab_size for ids in (context_token_ids, *continuation_token_ids) for t in ids):
        raise ValueError(f"a token id is outside the vocabulary [0, {vocab_size})")


@dataclass
class ScoreGroup:
    """One scored context: its sequences and the scores they produced."""

    request_id: str
    context_token_ids: list[int]
    continuation_token_ids: list[list[int]]
    arrival_time: float
    context: Sequence | None = None  # runs the context but its last token; None once forked (or never)
    scores: list[ContinuationScore | None] = field(default_factory=list)
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None

    def __post_init__(self) -> None:
        self.scores = [None] * len(self.continuation_token_ids)

    def first_sequences(self, max_model_len: int, sample_key: str | None) -> list[Sequence]:
        """What runs first: the context but its last token (the continuations fork from it once it is
        computed), or with a one-token context, nothing to share, the continuations themselves."""
        params = SamplingParams(temperature=0.0, max_tokens=1)  # never sampled: the parts are prompt-only
        if len(self.context_token_ids) > 1:
            self.context = Sequence(self.request_id, 0, self.context_token_ids[:-1], params, self.arrival_time,
                                    max_model_len, sample_key)
            self.context.is_prompt_only = True
            return [self.context]
        return [self.continuation(i, params, max_model_len, sample_key)
                for i in range(len(self.continuation_token_ids))]

    def continuation(self, index: int, params, max_model_len: int, sample_key: str | None) -> Sequence:
        """The prompt-only sequence of continuation `index`: the context then the continuation, owing the
        log-probability of every continuation token."""
        seq = Sequence(self.request_id, index, self.context_token_ids + self.continuation_token_ids[index],
                       params, self.arrival_time, max_model_len, sample_key)
        seq.is_prompt_only = True
        seq.prompt_logprobs = PromptLogprobState(num_top=0, start=len(self.context_token_ids))
        return seq

    def record(self, seq: Sequence) -> None:
        """A continuation's prompt is computed: its score."""
        index = seq.sample_index
        scheduled = seq.times.first_scheduled_time
        if scheduled is not None and (self.first_scheduled_time is None
                                      or scheduled < self.first_scheduled_time):
            self.first_scheduled_time = scheduled
        self.scores[index] = ContinuationScore(index, list(self.continuation_token_ids[index]),
                                               list(seq.prompt_logprobs.logprobs), list(seq.prompt_logprobs.ranks))

    @property
    def is_done(self) -> bool:
        return all(score is not None for score in self.scores)

    def output(self) -> ScoreOutput:
        metrics = RequestMetrics(arrival_time=self.arrival_time, first_scheduled_time=self.first_scheduled_time,
                                 first_token_time=None, last_token_time=time.monotonic())
        return ScoreOutput(self.request_id, list(self.context_token_ids), list(self.scores), self.num_cached_tokens,
                           metrics)
