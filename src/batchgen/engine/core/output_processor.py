"""OutputProcessor: what a step's tokens mean for their requests (vLLM v1's output processor).

The scheduler applies a step's sampled rows to the sequences (Scheduler.update_from_output) and asks
`is_stopped` after each token, so an accepted run of drafts ends where plain decoding would. With the
StepUpdate it returns, this processor:
- applies the stop rules (vLLM's): EOS and stop tokens once past min_tokens, stop strings that end in
  text made once past min_tokens (searched in the incrementally decoded text, stop_strings.py), then
  max_tokens and max_model_len;
- finishes samples (their runner and proposer state released) and requests (their output made when the
  last sample ends);
- advances beam searches once every live beam reported its candidates (beam_search.py), and forks a
  scored context's continuations or records their scores (score_group.py);
- makes the outputs: a RequestOutput (text decoded once, at the end; top and prompt log-probabilities
  with their tokens' texts) or a ScoreOutput when a request finishes, and for the requests whose
  output_kind asks, one each step they advanced (RequestOutputKind: DELTA, CUMULATIVE).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from batchgen.engine.core.outputs import (
    CompletionOutput,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    RequestOutputKind,
    ScoreOutput,
    TopLogprob,
)
from batchgen.engine.core.scheduler import Scheduler, StepUpdate
from batchgen.engine.core.sequence import Sequence
from batchgen.engine.decoding.beam_search import BeamGroup
from batchgen.engine.decoding.prompt_logprobs import prompt_logprobs_output
from batchgen.engine.decoding.score_group import ScoreGroup
from batchgen.engine.decoding.stop_strings import IncrementalText, find_stop_string, stop_holdback
from batchgen.engine.decoding.thinking_budget import EngineReasoning
from batchgen.engine.kv.kv_cache_manager import KVCacheManager
from batchgen.engine.pooling.outputs import PoolingOutput, PoolingRequestOutput
from batchgen.engine.text.reasoning import ReasoningStream
from batchgen.engine.text.tokenizer import Tokenizer

FINAL_ONLY = RequestOutputKind.FINAL_ONLY
DELTA = RequestOutputKind.DELTA


@dataclass(slots=True)
class Reported:
    """What a DELTA request's outputs have carried of one sample so far."""

    num_tokens: int = 0
    num_chars: int = 0
    is_finished: bool = False  # its finish reason was sent


@dataclass
class RequestState:
    """One unfinished request: its sequences, what it asked for and what its outputs already said."""

    request_id: str
    prompt_token_ids: list[int]
    seqs: list[Sequence]  # its live sequences (a beam search's beams, a scored context's parts)
    arrival_time: float
    prompt: str | None
    output_kind: RequestOutputKind = FINAL_ONLY
    beam: BeamGroup | None = None
    score: ScoreGroup | None = None
    is_pooling: bool = False  # a pooling model's request: one prompt-only sequence, its pooled logits the output
    reported: list[Reported] = field(default_factory=list)  # DELTA: per sample index
    num_outputs: int = 0  # outputs made so far (a DELTA request sends prompt_logprobs in its first)
    prompt_logprobs: PromptLogprobs | None = None  # made once, when first output
    is_reasoning_opened: bool = False  # its prompt left the thinking block open (reasoning parser)
    reasoning_streams: dict[int, ReasoningStream] = field(default_factory=dict)  # DELTA: per sample index


class OutputProcessor:
    """Everything a step's results become on the host once the scheduler applied them: the stop rules,
    finished samples released, beams advanced, scored contexts forked and recorded, prompt
    log-probabilities, detokenized text and the RequestOutputs / ScoreOutputs per output_kind. It holds
    the unfinished requests (`requests`, the engine's registry)."""

    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: tuple[int, ...], scheduler: Scheduler,
                 kv_cache_manager: KVCacheManager, max_model_len: int, release: Callable[[Sequence], None],
                 is_speculative: bool):
        """`release(seq)`: what the runner and the draft proposer keep for a finished sequence goes back;
        `is_speculative`: outputs report each sample's accepted drafts (speculative decoding is on)."""
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.scheduler = scheduler
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len
        self.release = release
        self.is_speculative = is_speculative
        self.requests: dict[str, RequestState] = {}  # the unfinished requests, by id
        self.num_streamed_requests = 0  # unfinished requests whose output_kind is not FINAL_ONLY
        self.reasoning: EngineReasoning | None = None  # the engine's reasoning parser: outputs split by it

    def add(self, state: RequestState) -> None:
        """Register a request the engine just queued."""
        self.requests[state.request_id] = state
        if state.output_kind is not FINAL_ONLY:
            self.num_streamed_requests += 1
            state.reported = [Reported() for _ in state.seqs]

    def remove(self, request_id: str) -> RequestState | None:
        """Forget a request (finished or aborted); None when it is not here."""
        state = self.requests.pop(request_id, None)
        if state is not None and state.output_kind is not FINAL_ONLY:
            self.num_streamed_requests -= 1
        return state

    # ---- after a step -----------------------------------------------------------------------------
    def process(self, update: StepUpdate) -> list[RequestOutput | ScoreOutput]:
        """Finish what the step's tokens stopped, advance beams and scored contexts; the step's outputs."""
        outputs: list[RequestOutput | ScoreOutput] = []
        unseen = {id(seq) for seq in update.finished}
        for seq in update.finished:  # a request's output comes where its last sample stopped
            unseen.discard(id(seq))
            self._finish(seq, outputs, unseen)
        for seq in update.prompts_done:
            self._prompt_done(seq, outputs)
        reported: dict[int, BeamGroup] = {}  # beam groups with candidates from this step
        for seq, candidates in update.beam_candidates:
            seq.beam.report(seq, candidates)
            reported[id(seq.beam)] = seq.beam
        for group in reported.values():
            request_id = group.beams[0].request_id
            if group.is_ready and request_id in self.requests:
                self._advance_beams(self.requests[request_id], outputs)
        if self.num_streamed_requests:
            self._stream(update.advanced, outputs)
        return outputs

    def _finish(self, seq: Sequence, outputs: list, unseen: set[int]) -> None:
        """`unseen`: the step's stopped sequences not processed yet (their request is not done before them)."""
        self.release(seq)
        state = self.requests[seq.request_id]
        if all(x.is_finished and id(x) not in unseen for x in state.seqs):
            outputs.append(self._delta_output(state, is_finished=True) if state.output_kind is DELTA
                           else self._make_output(state))
            self.remove(seq.request_id)

    def _prompt_done(self, seq: Sequence, outputs: list) -> None:
        """A scored context's part computed its prompt: the context forks its continuations (holding its
        blocks), a continuation's score is recorded; the last one finishes the request."""
        state = self.requests[seq.request_id]
        if state.is_pooling:
            self.scheduler.finish(seq)
            self.release(seq)
            outputs.append(pooling_output(state, seq))
            self.remove(seq.request_id)
            return
        group = state.score
        if seq is group.context:
            group.num_cached_tokens = seq.num_cached_tokens or 0
            group.first_scheduled_time = seq.times.first_scheduled_time
            children = [group.continuation(i, seq.params, self.max_model_len, seq.sample_key)
                        for i in range(len(group.continuation_token_ids))]
            for child in children:
                self.kv_cache_manager.fork(seq, child)
                child.num_cached_tokens = seq.num_cached_tokens
                child.times.first_scheduled_time = seq.times.first_scheduled_time
                self.scheduler.add_running(child)
            # The forks hold the context's blocks now; its own references go back (below).
            group.context = None
            state.seqs = children
        else:
            group.record(seq)
        self.scheduler.finish(seq)
        self.release(seq)
        if group.is_done:
            outputs.append(group.output())
            self.remove(seq.request_id)

    def _advance_beams(self, state: RequestState, outputs: list) -> None:
        """Every live beam reported its candidates: HF's selection, then the next beams as sequences
        (beam_search.py `BeamGroup.advance`): forks hold their parent's blocks, ended beams give theirs back."""
        group = state.beam

        def fork(parent: Sequence, sample_index: int) -> Sequence:
            child = parent.fork(sample_index)
            self.kv_cache_manager.fork(parent, child)
            return child

        def end(seq: Sequence) -> None:
            self.scheduler.finish(seq)
            self.release(seq)

        if group.advance(fork, self.scheduler.add_running, end):
            decode = None if self.tokenizer is None else self.tokenizer.decode
            outputs.append(group.output(state.request_id, state.prompt_token_ids, state.arrival_time,
                                        state.prompt, decode))
            self.remove(state.request_id)
        else:
            state.seqs = list(group.beams)

    # ---- stop rules ---------------------------------------------------------------------------------
    def is_stopped(self, seq: Sequence) -> bool:
        """vLLM's stops, after the sequence's newest token: EOS and stop tokens once past min_tokens; stop
        strings that end in text made once past min_tokens; then max_tokens and max_model_len. Sets the
        finish (and stop) reason."""
        p = seq.params
        token = seq.token_ids[-1]
        is_past_min = seq.num_output_tokens > p.min_tokens
        if not p.ignore_eos and token in self.eos_token_ids and is_past_min:
            seq.finish_reason, seq.stop_reason = "stop", None
        elif token in p.stop_token_ids and is_past_min:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif p.stop and self._is_stopped_by_string(seq):
            seq.finish_reason = "stop"
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= seq.max_total_tokens:
            seq.finish_reason = "length"
        return seq.finish_reason is not None

    def _is_stopped_by_string(self, seq: Sequence) -> bool:
        """Decode the newest tokens only (stop_strings.py) and search the new text (and the few
        characters before it a stop string may start in).

        Up to min_tokens tokens only the text grows, and that text is marked as searched: as in vLLM, a
        stop string counts only when it ends in text made after min_tokens, so what the first min_tokens
        tokens say can never cut the output short of them.
        """
        params = seq.params
        state = self._text_state(seq)
        start = state.num_checked_chars
        state.num_checked_chars = len(state.text)
        if seq.num_output_tokens <= params.min_tokens:
            return False
        hit = find_stop_string(state.text, params.stop, start)
        if hit is None:
            return False
        # Found: cut the whole output's text once (as the output will be decoded), else the window's.
        text = self.tokenizer.decode(seq.output_token_ids, params.skip_special_tokens)
        full_hit = find_stop_string(text, params.stop, start)
        if full_hit is None:
            text, full_hit = state.text, hit
        cut, stop = full_hit
        state.stop_text = text[:cut + len(stop) if params.include_stop_str_in_output else cut]
        seq.stop_reason = stop
        return True

    def _text_state(self, seq: Sequence) -> IncrementalText:
        """The sequence's incremental text, extended to its newest known token."""
        state = seq.text_state
        if state is None:
            state = seq.text_state = IncrementalText()
        skip_special = seq.params.skip_special_tokens
        state.update(lambda ids: self.tokenizer.decode(ids, skip_special), seq.token_ids, seq.num_prompt_tokens,
                     seq.num_known_tokens)
        return state

    # ---- outputs ------------------------------------------------------------------------------------
    def _make_output(self, state: RequestState, is_finished: bool = True) -> RequestOutput:
        """The request's whole output so far (finished: FINAL_ONLY's and CUMULATIVE's last)."""
        completions = [self._completion(seq) for seq in state.seqs]
        if self.reasoning is not None:
            for seq, completion in zip(state.seqs, completions):
                self._split_whole(state, seq, completion)
        return self._request_output(state, completions, self._prompt_logprobs(state), is_finished)

    def _split_whole(self, state: RequestState, seq: Sequence, completion: CompletionOutput) -> None:
        """A sample's whole text split by the reasoning parser, its reasoning tokens counted."""
        reasoning = self.reasoning
        completion.reasoning_content, completion.content = reasoning.parser.split(
            completion.text, state.is_reasoning_opened)
        completion.num_reasoning_tokens = reasoning.count(seq.grammar, _text_token_ids(seq),
                                                          state.is_reasoning_opened)

    def _split_delta(self, state: RequestState, seq: Sequence, completion: CompletionOutput) -> None:
        """A DELTA piece split by the sample's ReasoningStream (a tag cut between pieces is held back)."""
        if self.reasoning is None:
            return
        stream = state.reasoning_streams.get(seq.sample_index)
        if stream is None:
            stream = state.reasoning_streams[seq.sample_index] = ReasoningStream(self.reasoning.parser,
                                                                                 state.is_reasoning_opened)
        reasoning, content = stream.feed(completion.text)
        if seq.is_finished:
            rest_reasoning, rest_content = stream.finish()
            reasoning, content = reasoning + rest_reasoning, content + rest_content
            completion.num_reasoning_tokens = self.reasoning.count(
                seq.grammar, _text_token_ids(seq), state.is_reasoning_opened)
        completion.reasoning_content = reasoning if stream.has_thought else None
        completion.content = content

    def _delta_output(self, state: RequestState, is_finished: bool) -> RequestOutput:
        """What is new in each sample since the request's last output (DELTA)."""
        completions = []
        for seq in state.seqs:
            reported = state.reported[seq.sample_index]
            if reported.is_finished:
                continue
            num_tokens = seq.num_known_tokens - seq.num_prompt_tokens
            text = self._text(seq)
            if num_tokens == reported.num_tokens and len(text) == reported.num_chars and not seq.is_finished:
                continue
            completion = self._completion(seq, reported.num_tokens, text[reported.num_chars:])
            self._split_delta(state, seq, completion)
            completions.append(completion)
            reported.num_tokens, reported.num_chars = num_tokens, len(text)
            reported.is_finished = seq.is_finished
        prompt_logprobs = self._prompt_logprobs(state) if state.num_outputs == 0 else None
        return self._request_output(state, completions, prompt_logprobs, is_finished)

    def _stream(self, advanced: list[Sequence], outputs: list) -> None:
        """An unfinished output for each request that advanced and asks for one each step."""
        states: dict[str, RequestState] = {}
        for seq in advanced:
            state = self.requests.get(seq.request_id)
            if state is not None and state.output_kind is not FINAL_ONLY:
                states.setdefault(seq.request_id, state)
        for state in states.values():
            if state.output_kind is DELTA:
                outputs.append(self._delta_output(state, is_finished=False))
            else:
                outputs.append(self._make_output(state, is_finished=False))

    def _request_output(self, state: RequestState, completions: list[CompletionOutput],
                        prompt_logprobs: PromptLogprobs | None, is_finished: bool = True) -> RequestOutput:
        state.num_outputs += 1
        times = [s.times for s in state.seqs]
        metrics = RequestMetrics(
            arrival_time=state.arrival_time,
            first_scheduled_time=_earliest(t.first_scheduled_time for t in times),
            first_token_time=_earliest(t.first_token_time for t in times),
            last_token_time=max((t.last_token_time for t in times if t.last_token_time is not None), default=None))
        return RequestOutput(state.request_id, state.prompt_token_ids, completions,
                             state.seqs[0].num_cached_tokens or 0, metrics, finished=is_finished,
                             prompt=state.prompt, prompt_logprobs=prompt_logprobs)

    def _completion(self, seq: Sequence, num_old_tokens: int = 0, text: str | None = None) -> CompletionOutput:
        """The sample's output from its `num_old_tokens`-th token on (0: all of it); `text` its text from
        there (default: all of it)."""
        params = seq.params
        start = seq.num_prompt_tokens + num_old_tokens
        times = seq.times
        return CompletionOutput(
            index=seq.sample_index, text=self._text(seq) if text is None else text,
            token_ids=seq.token_ids[start:seq.num_known_tokens], cumulative_logprob=seq.cumulative_logprob,
            logprobs=seq.output_logprobs[num_old_tokens:] if params.logprobs is not None else None,
            top_logprobs=self._top_logprobs(seq, num_old_tokens) if params.num_top_logprobs else None,
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason, error=seq.error,
            num_accepted_tokens=seq.num_accepted_tokens if self.is_speculative else None,
            first_scheduled_time=times.first_scheduled_time, first_token_time=times.first_token_time,
            last_token_time=times.last_token_time)

    def _text(self, seq: Sequence) -> str:
        """A finished sample's text; an unfinished one's so far, held back (RequestOutputKind)."""
        if self.tokenizer is None:
            return ""
        if not seq.is_finished:
            text = self._text_state(seq).text
            return text[:max(0, len(text) - stop_holdback(seq.params.stop))]
        if seq.text_state is not None and seq.text_state.stop_text is not None:
            return seq.text_state.stop_text
        return self.tokenizer.decode(_text_token_ids(seq), seq.params.skip_special_tokens)

    def _top_logprobs(self, seq: Sequence, start: int = 0) -> list[list[TopLogprob]]:
        positions = seq.output_top_logprobs[start:] if start else seq.output_top_logprobs
        ids = [token_id for position in positions for token_id, _ in position]
        texts = iter(self.tokenizer.token_texts(ids))
        return [[TopLogprob(token_id, next(texts), logprob) for token_id, logprob in position]
                for position in positions]

    def _prompt_logprobs(self, state: RequestState) -> PromptLogprobs | None:
        first = state.seqs[0]
        if first.params.prompt_logprobs is None:
            return None
        if state.prompt_logprobs is None:  # complete once the prompt is computed, before any output
            texts = self.tokenizer.token_texts if self.tokenizer is not None else (lambda ids: [""] * len(ids))
            state.prompt_logprobs = prompt_logprobs_output(first, texts)
        return state.prompt_logprobs


def _text_token_ids(seq: Sequence) -> list[int]:
    """The output tokens the text is decoded from: as in vLLM, all of them but a stop token (EOS or one
    of stop_token_ids) that ended the sample, unless include_stop_str_in_output. (A stop string sets the
    text itself: OutputProcessor._is_stopped_by_string.)"""
    ids = seq.output_token_ids
    is_stop_token = seq.finish_reason == "stop" and not isinstance(seq.stop_reason, str)
    if is_stop_token and ids and not seq.params.include_stop_str_in_output:
        return ids[:-1]
    return ids


def _earliest(values) -> float | None:
    return min((v for v in values if v is not None), default=None)


def pooling_output(state: RequestState, seq: Sequence) -> PoolingRequestOutput:
    """A pooling request's output: the score head's logits at its last token (pooling/outputs.py)."""
    metrics = RequestMetrics(arrival_time=state.arrival_time, first_scheduled_time=seq.times.first_scheduled_time,
                             first_token_time=None, last_token_time=time.monotonic())
    return PoolingRequestOutput(state.request_id, PoolingOutput(torch.tensor(seq.pooled, dtype=torch.float32)),
                                list(state.prompt_token_ids), True, seq.num_cached_tokens or 0, metrics)
