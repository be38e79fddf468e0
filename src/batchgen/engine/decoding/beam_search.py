"""Beam search as HF transformers' `generate(num_beams=W, do_sample=False)` runs it, on the engine's steps.

A request with SamplingParams.beam_width W > 1 starts as one sequence (its prompt, prefilled once). Each
live beam's step reports its K most likely next tokens (K = max(2, 1 + number of EOS tokens) x W, HF's
`beams_to_keep`: enough that W candidates survive even when every beam's best ones end). When every
live beam of the group has reported, `BeamGroup.select` does what one iteration of HF's `_beam_search`
does (transformers 5's vectorised version):
- the K best (beam score + token log-probability) over all beams' candidates;
- the best W of them that do not end (EOS, max_tokens, max_model_len) are the next beams;
- those among the best W that end are finished hypotheses, scored cumulative log-probability /
  generated length ** length_penalty (the ending token counted), and the best W hypotheses are kept;
- early stopping, HF's rule: with `early_stopping: true` the search ends once W hypotheses are kept;
  otherwise (false, HF's default) once W are kept and the best running beam's score at its current
  length (`"never"` with length_penalty > 0: at max_tokens) cannot beat the worst kept one; and it ends
  when every one of the K candidates ends (max_tokens reached).
`BeamGroup.advance` turns the selection into sequences through the output processor's callbacks:
a beam that continues more than once is forked, its copies holding the same KV blocks (the prompt's
and every full block since; the last, partial block is copied when a fork first writes into it:
kv_cache_manager.py), and a beam with no continuation gives its blocks back.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from batchgen.engine.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from batchgen.engine.core.sequence import Sequence
from batchgen.engine.sampling.sampling_params import SamplingParams


@dataclass
class BeamSearchParams:
    """vLLM's `BeamSearchParams` (plus HF's `early_stopping`): `LLM.beam_search` returns the `beam_width`
    best beams. Beam search samples nothing: `temperature` is accepted for vLLM's signature and must be 0."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False

    def to_sampling_params(self) -> SamplingParams:
        return SamplingParams(n=self.beam_width, beam_width=self.beam_width, max_tokens=self.max_tokens,
                              ignore_eos=self.ignore_eos, temperature=self.temperature,
                              length_penalty=self.length_penalty, early_stopping=self.early_stopping,
                              logprobs=0)


@dataclass
class BeamSearchSequence:
    """vLLM's: a returned beam. `tokens` are the prompt's then the beam's; `logprobs` each generated token's
    raw log-probability; `score` the length-penalised score it was ranked by."""

    tokens: list[int]
    logprobs: list[float]
    cum_logprob: float
    text: str | None
    finish_reason: str | None
    stop_reason: int | str | None
    score: float


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


def beam_score(cumulative_logprob: float, num_generated: int, length_penalty: float) -> float:
    """HF's finished-hypothesis score: cumulative log-probability / generated length ** length_penalty.

    SamplingParams keeps |length_penalty| <= 10, where the power is a finite, non-zero float64 for any
    length; outside that this still raises nothing: a length below 1 counts as 1, a power past float64's
    range gives the limit (-0.0 for a negative log-probability), one below it -inf (0.0 for 0)."""
    length = max(num_generated, 1)
    try:
        denominator = float(length) ** length_penalty
    except OverflowError:  # length ** length_penalty past float64's range: the score's limit is 0
        return cumulative_logprob * 0.0
    if denominator == 0.0:  # underflow: the score's limit is -inf for any log-probability below 0
        return -math.inf if cumulative_logprob < 0 else cumulative_logprob * 0.0
    return cumulative_logprob / denominator


@dataclass
class Hypothesis:
    """A finished beam: its generated tokens and their log-probabilities."""

    token_ids: list[int]
    logprobs: list[float]
    cumulative_logprob: float
    score: float
    finish_reason: str  # stop (EOS) | length


@dataclass
class Candidate:
    score: float  # the beam's cumulative log-probability with this token
    beam: Sequence
    token_id: int
    logprob: float
    is_end: bool = False


@dataclass
class Selection:
    """One step's outcome: the next beams as (parent, token, logprob), best first; whether the search ended."""

    children: list[Candidate]
    is_done: bool


@dataclass
class BeamGroup:
    """The state of one request's beam search (the engine owns the sequences)."""

    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    beams: list[Sequence] = field(default_factory=list)  # live beams
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most beam_width
    # id(live beam) -> its most likely next tokens (token id, logprob), reported by this step's row.
    candidates: dict[int, list[tuple[int, float]]] = field(default_factory=dict)
    is_improvable: bool = True  # HF's is_early_stop_heuristic_unsatisfied
    num_forks: int = 0  # sample indices handed to forked beams

    @property
    def width(self) -> int:
        return self.params.beam_width

    @property
    def num_candidates(self) -> int:
        """Candidates each beam reports per step (HF's beams_to_keep)."""
        num_eos = 0 if self.params.ignore_eos else len(self.eos_token_ids)
        return max(2, 1 + num_eos) * self.width

    def report(self, seq: Sequence, candidates: list[tuple[int, float]]) -> None:
        """A live beam's next-token distribution is computed: its candidates wait for the group's selection."""
        self.candidates[id(seq)] = candidates

    @property
    def is_ready(self) -> bool:
        """Every live beam has reported its candidates for the next position."""
        return all(id(seq) in self.candidates for seq in self.beams)

    def _ends(self, seq: Sequence, token_id: int) -> str | None:
        params = self.params
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return "stop"
        if seq.num_output_tokens + 1 >= params.max_tokens or seq.num_tokens + 1 >= seq.max_total_tokens:
            return "length"
        return None

    def select(self) -> Selection:
        """One iteration of HF's beam search over the live beams' candidates (see the module docstring)."""
        width = self.width
        candidates = [Candidate(seq.cumulative_logprob + logprob, seq, token_id, logprob)
                      for seq in self.beams for token_id, logprob in self.candidates[id(seq)]]
        candidates.sort(key=lambda c: -c.score)
        top = candidates[:self.num_candidates]
        endings = [self._ends(c.beam, c.token_id) for c in top]
        for c, end in zip(top, endings):
            c.is_end = end is not None
        children = [c for c in top if not c.is_end][:width]
        num_generated = self.beams[0].num_output_tokens + 1  # the candidates' generated length
        if self.is_improvable and not (self.params.early_stopping is True and len(self.finished) == width):
            # Only the best `width` candidates may finish; the rest exist so that `width` beams go on.
            for c, end in zip(top[:width], endings[:width]):
                if end is not None:
                    self.finished.append(Hypothesis(
                        c.beam.output_token_ids + [c.token_id], c.beam.output_logprobs + [c.logprob],
                        c.score, beam_score(c.score, num_generated, self.params.length_penalty), end))
            self.finished.sort(key=lambda h: -h.score)
            del self.finished[width:]
        is_full = len(self.finished) == width
        if is_full and children:
            length = num_generated
            if self.params.early_stopping == "never" and self.params.length_penalty > 0:
                length = self.params.max_tokens
            best_running = beam_score(children[0].score, length, self.params.length_penalty)
            self.is_improvable = self.is_improvable and best_running > self.finished[-1].score
        is_done = (not self.is_improvable or (self.params.early_stopping is True and is_full)
                   or all(c.is_end for c in top))
        return Selection(children, is_done)

    def advance(self, fork: Callable[[Sequence, int], Sequence], start: Callable[[Sequence], None],
                end: Callable[[Sequence], None]) -> bool:
        """Select (HF's iteration), then make the next beams: a beam continued k times keeps the first
        continuation and is forked (`fork(parent, sample index)`: a copy holding its blocks) for the other
        k - 1, which `start` hands to the scheduler; a beam not continued, or every beam once the search
        is done, goes to `end`. True when the search is done."""
        selection = self.select()
        self.candidates.clear()
        if selection.is_done:
            for seq in self.beams:
                end(seq)
            return True
        by_parent: dict[int, list[Candidate]] = {}
        for c in selection.children:
            by_parent.setdefault(id(c.beam), []).append(c)
        next_seq: dict[int, Sequence] = {}  # candidate -> its sequence
        for parent in self.beams:
            continued = by_parent.get(id(parent))
            if not continued:
                end(parent)
                continue
            for c in continued[1:]:  # forked before the parent takes its own next token
                self.num_forks += 1
                child = fork(parent, self.num_forks)
                child.append_token(c.token_id, c.logprob)
                start(child)
                next_seq[id(c)] = child
            parent.append_token(continued[0].token_id, continued[0].logprob)
            next_seq[id(continued[0])] = parent
        self.beams = [next_seq[id(c)] for c in selection.children]
        return False

    def output(self, request_id: str, prompt_token_ids: list[int], arrival_time: float, prompt: str | None,
               decode: Callable[[list[int], bool], str] | None) -> RequestOutput:
        """The finished search: the n best hypotheses, best first, each with its score."""
        params = self.params
        now = time.monotonic()
        times = [s.times for s in self.beams]
        first_scheduled = min((t.first_scheduled_time for t in times if t.first_scheduled_time is not None),
                              default=None)
        first_token = min((t.first_token_time for t in times if t.first_token_time is not None), default=None)
        completions = [CompletionOutput(
            index=rank, text="" if decode is None else decode(h.token_ids, params.skip_special_tokens),
            token_ids=list(h.token_ids), cumulative_logprob=h.cumulative_logprob,
            logprobs=list(h.logprobs) if params.logprobs is not None else None, finish_reason=h.finish_reason,
            first_scheduled_time=first_scheduled, first_token_time=first_token, last_token_time=now, score=h.score)
            for rank, h in enumerate(self.finished[:params.n])]
        metrics = RequestMetrics(arrival_time=arrival_time, first_scheduled_time=first_scheduled,
                                 first_token_time=first_token, last_token_time=now)
        num_cached = (self.beams[0].num_cached_tokens or 0) if self.beams else 0
        return RequestOutput(request_id, prompt_token_ids, completions, num_cached, metrics, prompt=prompt)
