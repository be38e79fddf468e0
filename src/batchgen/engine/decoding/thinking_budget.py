"""ReasoningGate: a sample's thinking, counted and bounded (SamplingParams.thinking_token_budget).

It sits in the sequence's grammar slot (Sequence.grammar) and answers what a GrammarState answers
(accept_token, fill_bitmask, validate_tokens, rollback, is_terminated), so the step's bitmask path,
the scheduler's token acceptance and speculative decoding's draft checks drive it unchanged:
- while the sample thinks, every token is allowed and counted; once `budget` reasoning tokens are
  written, the bitmask row allows only the next token of the end marker (the reasoning parser's
  `</think>`, as the tokenizer encodes it) until the whole marker is written: the thinking ends there
  and the answer follows, sampled freely;
- a structured-output constraint (`inner`, a GrammarState) applies to the answer only, from the end
  of the thinking on (vLLM does the same with a reasoning parser), so a model thinks before it writes
  a forced JSON or tool call.

Whether the sample starts inside the thinking is known from the prompt (its template opened the
block) or the parser (DeepSeek-R1 always thinks); otherwise the gate watches the first tokens for
the start marker (Qwen3 writes `<think>` itself) and, when they are something else, the sample does
not think (and a constraint applies from its first token).

Reasoning tokens are the tokens between the markers: the start marker and the end marker are not
counted. The gate replays an output's tokens to count them when a sample had no budget
(`count_reasoning_tokens`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from batchgen.engine.decoding.structured.grammar_state import TokenAcceptor

_START, _THINK, _ANSWER = "start", "think", "answer"


class ReasoningGate(TokenAcceptor):
    def __init__(self, budget: int | None, start_ids: Sequence[int], end_ids: Sequence[int],
                 starts_thinking: bool | None, inner=None):
        """`starts_thinking`: True (inside the thinking from the first token), None (if the output opens
        with `start_ids`); `inner`: the answer's GrammarState or None."""
        self.budget = budget
        self.start_ids, self.end_ids = list(start_ids), list(end_ids)
        self.inner = inner
        self.stop_token_ids = inner.stop_token_ids if inner is not None else ()
        self.tokens: list[int] = []
        self.phase = _THINK if starts_thinking else (_ANSWER if inner is not None else _START)
        self.think_start = 0  # where the reasoning tokens begin in `tokens`
        self.num_forced = 0  # end-marker tokens forced so far (0: not forcing)
        self.reasoning_end = 0  # where the reasoning tokens end in `tokens`, once the thinking ended
        self._history: list[tuple] = []  # the state before each accepted token (rollback)

    # ---- what the sampler's bitmask path asks ----------------------------------------------------------
    @property
    def is_terminated(self) -> bool:
        return self.phase == _ANSWER and self.inner is not None and self.inner.is_terminated

    @property
    def library_error(self) -> str:
        """Why a token was refused: the answer's grammar's own account ('' when it has none)."""
        return getattr(self.inner, "library_error", "") if self.inner is not None else ""

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_reasoning_tokens(self) -> int:
        if self.phase == _THINK:
            return len(self.tokens) - self.think_start - self.num_forced
        return self.reasoning_end - self.think_start if self.phase == _ANSWER else 0

    def forced_token(self) -> int | None:
        """The one token the next position must take, or None."""
        if self.phase != _THINK or self.budget is None:
            return None
        if self.num_forced or len(self.tokens) - self.think_start >= self.budget:
            return self.end_ids[self.num_forced]
        return None

    def accept_token(self, token_id: int) -> bool:
        forced = self.forced_token()
        if forced is not None and token_id != forced:
            return False
        snapshot = (self.phase, self.think_start, self.num_forced, self.reasoning_end, False)
        if self.phase == _ANSWER:
            if self.inner is not None:
                if not self.inner.accept_token(token_id):
                    return False
                snapshot = snapshot[:4] + (True,)
        self._history.append(snapshot)
        self.tokens.append(token_id)
        if self.phase == _START:
            self._after_start_token()
        elif self.phase == _THINK:
            if forced is not None:
                self.num_forced += 1
                if self.num_forced == len(self.end_ids):
                    self._end_thinking(len(self.tokens) - self.num_forced)
            elif self.tokens[-len(self.end_ids):] == self.end_ids and \
                    len(self.tokens) - len(self.end_ids) >= self.think_start:
                self._end_thinking(len(self.tokens) - len(self.end_ids))
        return True

    def _after_start_token(self) -> None:
        written = self.tokens
        if written == self.start_ids[:len(written)]:
            if len(written) == len(self.start_ids):
                self.phase, self.think_start = _THINK, len(written)
            return
        self.phase = _ANSWER  # the output did not open the thinking: it does not think

    def _end_thinking(self, end: int) -> None:
        self.phase, self.reasoning_end, self.num_forced = _ANSWER, end, 0

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= len(self.tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {len(self.tokens)} accepted")
        num_inner = 0
        for _ in range(num_tokens):
            self.tokens.pop()
            self.phase, self.think_start, self.num_forced, self.reasoning_end, by_inner = self._history.pop()
            num_inner += by_inner
        if num_inner:
            self.inner.rollback(num_inner)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int, draft_token_ids: Sequence[int] = ()) -> None:
        """Rows row .. row + k: the forced token alone, the answer's grammar, or every token."""
        num_advanced = 0
        try:
            for j in range(len(draft_token_ids) + 1):
                self._fill_row(bitmask, row + j)
                if j < len(draft_token_ids):
                    if not self.accept_token(draft_token_ids[j]):
                        raise ValueError(f"draft {j} (token {draft_token_ids[j]}) is not allowed here: cut the "
                                         "drafts with validate_tokens first")
                    num_advanced += 1
        finally:
            self.rollback(num_advanced)

    def _fill_row(self, bitmask: torch.Tensor, row: int) -> None:
        forced = self.forced_token()
        if forced is not None:
            bitmask[row].zero_()
            bit = forced % 32
            bitmask[row, forced // 32] = (1 << bit) if bit < 31 else -(1 << 31)  # int32's sign bit
        elif self.phase == _ANSWER and self.inner is not None:
            self.inner.fill_bitmask(bitmask, row)
        else:
            bitmask[row].fill_(-1)


def count_reasoning_tokens(output_ids: Sequence[int], start_ids: Sequence[int], end_ids: Sequence[int],
                           starts_thinking: bool | None) -> int:
    """The reasoning tokens of a finished output (the tokens between the markers)."""
    gate = ReasoningGate(None, start_ids, end_ids, starts_thinking)
    for token in output_ids:
        gate.accept_token(token)
    return gate.num_reasoning_tokens


class EngineReasoning:
    """An engine's reasoning parser with its markers as token ids: what add_request and the output
    processor ask of it."""

    def __init__(self, parser, tokenizer):
        self.parser = parser  # engine/text/reasoning.py's ReasoningParser
        self.tokenizer = tokenizer
        self.start_ids = tokenizer.encode(parser.start_tag, add_special_tokens=False)
        self.end_ids = tokenizer.encode(parser.end_tag, add_special_tokens=False)

    @classmethod
    def create(cls, name: str | None, tokenizer) -> EngineReasoning | None:
        if name is None or tokenizer is None:
            return None
        from batchgen.engine.text.reasoning import get_reasoning_parser

        return cls(get_reasoning_parser(name), tokenizer)

    def is_opened_by_prompt(self, prompt_ids: Sequence[int]) -> bool:
        """Whether the prompt's last tokens leave the thinking block open."""
        tail = self.tokenizer.decode(list(prompt_ids[-16:]), skip_special_tokens=False)
        return self.parser.is_opened_by_prompt(tail)

    def gates(self, budget: int | None, is_opened: bool, grammars: list | None, num_samples: int) -> list | None:
        """Each sample's grammar slot: a ReasoningGate where the thinking is bounded, or where a
        constraint must wait for the thinking to end; else `grammars` as they are."""
        starts = self.parser.starts_thinking(is_opened)
        if budget is None and not (grammars and starts):
            return grammars
        inner = grammars or [None] * num_samples
        return [ReasoningGate(budget, self.start_ids, self.end_ids, starts, g) for g in inner]

    def count(self, seq_grammar, output_ids: Sequence[int], is_opened: bool) -> int:
        """A sample's reasoning tokens: its gate's count, else counted over its tokens."""
        if isinstance(seq_grammar, ReasoningGate):
            return seq_grammar.num_reasoning_tokens
        return count_reasoning_tokens(output_ids, self.start_ids, self.end_ids,
                                      self.parser.starts_thinking(is_opened))
