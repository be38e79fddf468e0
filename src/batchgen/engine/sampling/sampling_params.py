"""SamplingParams: vLLM's names and meanings, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from batchgen.engine.config import check_settings
from batchgen.engine.core.outputs import RequestOutputKind
from batchgen.engine.decoding.structured.params import StructuredOutputError, StructuredOutputsParams

MAX_TEMPERATURE = 100.0  # far past any useful value (near-uniform long before): keeps inf and typos out
# The smallest temperature above 0 (vLLM treats below 1e-5 as greedy). The sampler divides float32 logits
# by it: 1e-300 would be 0 there and every probability NaN; 1e-5 keeps them finite.
MIN_TEMPERATURE = 1e-5
# repetition_penalty's range: it divides and multiplies float32 logits, so 1e308 would be inf there (0 x inf
# is NaN) and 1e-300 would be 0; within [1e-6, 1e6] a penalised logit stays finite (vLLM and HF take any
# float > 0; past these the penalty is already total).
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-6, 1e6
# Samples per request. The n sequences of a request are created when it is added and each holds KV
# blocks and a scheduler slot, so n is bounded like any other allocation: 1024 covers best-of-n and
# RL-style sampling (OpenAI's API stops at 128) while keeping one request's bookkeeping small.
MAX_N = 1024
# Top log-probabilities per token (vLLM's default max_logprobs; OpenAI's top_logprobs stops at 20).
# prompt_logprobs has the same cap, as in vLLM: every prompt position of a request keeps its top N.
MAX_LOGPROBS = 20
# Beams per request. Each live beam is a sequence with a scheduler slot; HF and vLLM users run 4-16.
MAX_BEAM_WIDTH = 64
# |length_penalty| at most. Beam scores divide by length ** length_penalty: with |length_penalty| <= 10
# that stays a normal float64 for every length up to 2**63 tokens (2**630 and 2**-630, float64 reaching
# 2**1023), so no score overflows or divides by zero; HF and vLLM take any float, but past +-10 the
# ranking is already all length (HF's own examples use 0.6-2).
MAX_LENGTH_PENALTY = 10.0


@dataclass
class SamplingParams:
    """How to sample one request. temperature 0 means greedy.

    Penalties follow vLLM: repetition_penalty over prompt and output tokens (divides positive
    logits, multiplies negative ones), presence/frequency penalties over output tokens only.
    Stops follow vLLM: a stop string counts only when it ends in text made once `min_tokens` tokens
    exist, and neither it nor a stop token (EOS, `stop_token_ids`) is part of the text unless
    `include_stop_str_in_output`; the token ids always hold every generated token.
    `logprobs` follows vLLM: None records none, 0 the raw model log-probability of each chosen token,
    N also the N most likely tokens' (raw, before penalties and filters); True and False, the job
    file's spelling, mean 0 and None. `prompt_logprobs` (vLLM's): None, or N >= 0: the log-probability
    (and rank) of each prompt token after the first given the tokens before it, plus the N most likely
    tokens there (RequestOutput.prompt_logprobs).

    Beam search (`beam_width` > 1, HF's algorithm; beam_search.py): the `beam_width` most likely
    sequences are kept at each step, finished ones ranked by cumulative log-probability / generated
    length ** `length_penalty`; `early_stopping` is HF's (False: stop when no running beam can beat the
    worst finished one at its current length; True: when `beam_width` beams finished; "never": when
    none could at max_tokens). The `n` best beams are returned. It samples nothing, so every sampling
    setting must stay at its default (temperature 0). Every float is
    checked to be finite and in range (NaN fails every range). `stop_token_ids` are checked against
    the vocabulary and `max_tokens` against max_model_len where those are known (the engine's
    add_request, the pipeline's preflight).

    `output_kind` (vLLM's RequestOutputKind) says what `LLMEngine.step()` returns for the request:
    FINAL_ONLY (here the default: a batch job reads finished outputs only) its output once finished,
    DELTA what is new each step (a stream), CUMULATIVE everything so far each step.

    `structured_outputs` constrains the output (a JSON schema, a regex, a choice list, a grammar:
    StructuredOutputsParams, or a mapping of its fields); `guided_decoding` is vLLM's older name
    for it. A constrained output ends with EOS where its grammar is complete, so it takes neither
    `ignore_eos` nor `min_tokens` (the grammar decides the length).
    """

    n: int = 1
    """Samples per request (beam search: the best n beams)."""
    temperature: float = 1.0
    """Scales the logits before sampling: 0 (greedy: the most likely token) or in [1e-5, 100] (smaller
    would divide float32 logits by 0)."""
    top_p: float = 1.0
    """Sample from the smallest set of tokens whose probabilities add up to top_p, in (0, 1]."""
    top_k: int = -1
    """Sample from the k most likely tokens; -1: all."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely one's probability, in [0, 1]."""
    repetition_penalty: float = 1.0
    """Over prompt and output tokens: divides positive logits, multiplies negative ones; 1: off; in
    [1e-6, 1e6] (keeps penalised float32 logits finite)."""
    presence_penalty: float = 0.0
    """Subtracted from the logits of tokens that appeared in the output, in [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted per occurrence in the output, in [-2, 2]."""
    max_tokens: int = 16
    """Completion tokens at most."""
    min_tokens: int = 0
    """Completion tokens before EOS, stop token ids or stop strings may end it."""
    seed: int | None = None
    """Keys the request's draws (with its id and sample index): the same seed gives the same samples,
    whatever runs beside it; None means 0."""
    stop: list[str] = field(default_factory=list)
    """Strings that end the completion (not part of its text unless include_stop_str_in_output)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end the completion, besides EOS."""
    ignore_eos: bool = False
    """Keep generating past EOS, up to max_tokens (benchmarks)."""
    logprobs: int | bool | None = None
    """None: no log-probabilities; 0 (or true): the chosen tokens' raw log-probabilities; N: also the N
    most likely tokens' at each position."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the text (the token ids keep every token)."""
    include_stop_str_in_output: bool = False
    """Keep the stop string (or stop token) that ended the sample at the end of its text (vLLM's name)."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output: a JSON schema, a regex, a choice list or a grammar
    (StructuredOutputsParams, or a mapping of its fields)."""
    guided_decoding: StructuredOutputsParams | None = None
    """vLLM's older name of structured_outputs; moved there."""
    prompt_logprobs: int | None = None
    """None, or N >= 0: each prompt token's log-probability given the ones before it, plus the N most
    likely tokens there."""
    beam_width: int = 1
    """Beams kept at each step; 1: no beam search."""
    length_penalty: float = 1.0
    """Beam search: finished beams are ranked by cumulative log-probability / length ** length_penalty;
    in [-10, 10] (HF and vLLM take any float; this bound keeps length ** length_penalty a finite,
    non-zero float64 for every length, and past it the ranking is all length anyway)."""
    early_stopping: bool | str = False
    """Beam search (HF's): false stops when no running beam can beat the worst finished one, true when
    beam_width beams finished, "never" when none could at max_tokens."""
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY
    """What step() returns for this request (vLLM's RequestOutputKind): FINAL_ONLY, one output when it
    finishes; DELTA, what is new each step it advanced; CUMULATIVE, all of it so far each step."""
    thinking_token_budget: int | None = None
    """The most reasoning tokens a sample may write (vLLM's name): past it the reasoning parser's end
    marker (`</think>`) is forced and the answer follows. Needs a reasoning parser (model.reasoning_parser,
    --reasoning-parser); null: no limit."""

    def __post_init__(self) -> None:
        self._take_structured_outputs()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        self.logprobs = as_num_logprobs(self.logprobs)
        check_settings(self, [
            ("n", 1 <= self.n <= MAX_N, f"must be in [1, {MAX_N}]"),
            ("temperature", self.temperature == 0 or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE,
             "must be in [1e-5, 100] or 0"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", self.top_k == -1 or self.top_k >= 1, "must be -1 (off) or >= 1"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("repetition_penalty",
             MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
             "must be in [1e-6, 1e6]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("max_tokens", self.max_tokens >= 1, "must be >= 1"),
            ("min_tokens", 0 <= self.min_tokens <= self.max_tokens, "must be in [0, max_tokens]"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must hold non-empty strings"),
            ("stop_token_ids", all(t >= 0 for t in self.stop_token_ids), "must hold token ids >= 0"),
            ("logprobs", self.logprobs is None or (isinstance(self.logprobs, int)
                                                   and 0 <= self.logprobs <= MAX_LOGPROBS),
             f"must be None, True, False or in [0, {MAX_LOGPROBS}]"),
            ("ignore_eos", not (self.ignore_eos and self.structured_outputs is not None),
             "must be false with structured_outputs (the output ends with EOS where its grammar is complete)"),
            ("min_tokens", not (self.min_tokens and self.structured_outputs is not None),
             "must be 0 with structured_outputs (the grammar decides where the output may end)"),
            ("prompt_logprobs", self.prompt_logprobs is None or (
                isinstance(self.prompt_logprobs, int) and not isinstance(self.prompt_logprobs, bool)
                and 0 <= self.prompt_logprobs <= MAX_LOGPROBS), f"must be None or in [0, {MAX_LOGPROBS}]"),
            ("beam_width", 1 <= self.beam_width <= MAX_BEAM_WIDTH, f"must be in [1, {MAX_BEAM_WIDTH}]"),
            ("length_penalty", -MAX_LENGTH_PENALTY <= self.length_penalty <= MAX_LENGTH_PENALTY,
             f"must be in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}]"),
            ("early_stopping", self.early_stopping is False or self.early_stopping is True
             or self.early_stopping == "never", "must be false, true or never"),
            ("output_kind", isinstance(self.output_kind, RequestOutputKind),
             "must be a RequestOutputKind (FINAL_ONLY, DELTA or CUMULATIVE)"),
            ("thinking_token_budget", self.thinking_token_budget is None or (
                isinstance(self.thinking_token_budget, int) and not isinstance(self.thinking_token_budget, bool)
                and self.thinking_token_budget >= 0), "must be null or an integer >= 0"),
            ("thinking_token_budget", self.thinking_token_budget is None or self.beam_width == 1,
             "must be null with beam search (beam_width > 1)"),
        ])
        if self.is_beam_search:
            check_settings(self, self._beam_checks())
        else:
            check_settings(self, [
                ("n", not (self.n > 1 and self.is_greedy),
                 "must be 1 with greedy sampling (temperature 0 gives n identical samples)"),
                ("length_penalty", self.length_penalty == 1.0, "applies to beam search only (beam_width > 1)"),
                ("early_stopping", self.early_stopping is False, "applies to beam search only (beam_width > 1)"),
            ])

    def _beam_checks(self) -> list[tuple[str, bool, str]]:
        """Beam search keeps the most likely sequences: it samples nothing and stops at EOS or max_tokens."""
        sampling = "beam search samples nothing (beam_width > 1): leave it at its default"
        ends = "must be empty with beam search (beam_width > 1): beams end at EOS or max_tokens"
        return [
            ("n", self.n <= self.beam_width, "must be at most beam_width (the best n beams are returned)"),
            ("temperature", self.temperature == 0.0, "must be 0 with beam search (beam_width > 1): it samples nothing"),
            ("top_p", self.top_p == 1.0, sampling),
            ("top_k", self.top_k == -1, sampling),
            ("min_p", self.min_p == 0.0, sampling),
            ("repetition_penalty", self.repetition_penalty == 1.0, sampling),
            ("presence_penalty", self.presence_penalty == 0.0, sampling),
            ("frequency_penalty", self.frequency_penalty == 0.0, sampling),
            ("min_tokens", self.min_tokens == 0, "must be 0 with beam search (beam_width > 1)"),
            ("stop", not self.stop, ends),
            ("stop_token_ids", not self.stop_token_ids, ends),
            ("logprobs", not self.logprobs, ("must be None, False, True or 0 with beam search (beam_width > 1): "
                                             "each beam's tokens' log-probabilities, no top-N")),
            ("prompt_logprobs", self.prompt_logprobs is None, "must be None with beam search (beam_width > 1)"),
            ("structured_outputs", self.structured_outputs is None,
             "must be None with beam search (beam_width > 1): beams are not constrained"),
            ("output_kind", self.output_kind == RequestOutputKind.FINAL_ONLY,
             "must be FINAL_ONLY with beam search (beam_width > 1): the beams are ranked at the end"),
        ]

    def _take_structured_outputs(self) -> None:
        """The constraint as StructuredOutputsParams, from either name and either form."""
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise StructuredOutputError(None, "give structured_outputs or its older name guided_decoding, "
                                                  "not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                    StructuredOutputsParams):
            raise StructuredOutputError(None, f"must be StructuredOutputsParams or a mapping of its fields; got "
                                              f"{type(self.structured_outputs).__name__}")

    @property
    def num_top_logprobs(self) -> int:
        """How many most likely tokens to record per position besides the chosen one (0: none)."""
        return self.logprobs or 0

    @property
    def is_beam_search(self) -> bool:
        return self.beam_width > 1

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def is_constrained(self) -> bool:
        return self.structured_outputs is not None

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def as_num_logprobs(value: int | bool | None) -> int | None:
    """vLLM's logprobs from any accepted spelling: False/None -> None, True -> 0, N -> N."""
    if value is None or value is False:
        return None
    if value is True:
        return 0
    return value
