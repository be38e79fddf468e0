"""GrammarState: one request's position in its compiled grammar; fills its row of the step's bitmask.

The engine advances the state with each token the request emits (`accept_token`), asks it for the
next token's mask (`fill_bitmask`, one row of a packed int32 bitmask: bit j of word w allows token
32w + j), and can take tokens back (`rollback`) when speculative decoding rejects them. Once the
grammar is complete only the stop tokens are allowed; once one is accepted the state `is_terminated`.

Speculative decoding: `validate_tokens(drafts)` says how many leading drafts the grammar allows (the
proposer's drafts are cut there), and `fill_bitmask(bitmask, row, drafts)` fills the 1 + k rows a
verify chunk samples: row j is the mask after the first j drafts, each verify position masked as
plain decoding would mask it. Neither moves the state.

Two facts about llguidance's matcher shape this class. A token it refuses puts it in an error state
for good, so every token is validated before it is consumed and a refused one leaves the state as it
was. And a matcher whose grammar is complete (nothing can follow, as after a choice or a closed
JSON object) takes the stop token without counting it as a step, so `rollback` does not hand that one
to the matcher.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from batchgen.engine.decoding.structured.library import library_message


def fill_row(matcher, bitmask: torch.Tensor, row: int) -> None:
    """The library matcher's allowed next tokens into bitmask[row] (checked by the callers: a CPU int32
    (B, ceil(V / 32)) tensor, rows contiguous)."""
    target = bitmask[row]
    matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * target.element_size())


class TokenAcceptor:
    """What a sequence's grammar slot offers the scheduler and speculation beyond accept_token and
    rollback (which each kind defines): GrammarState, and the reasoning gate (thinking_budget.py)."""

    def accept_token(self, token_id: int) -> bool:
        raise NotImplementedError

    def rollback(self, num_tokens: int) -> None:
        raise NotImplementedError

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Advance through `token_ids` in order; at the first refused one stop and return False (the
        tokens before it stay accepted)."""
        return all(self.accept_token(t) for t in token_ids)

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        """How many leading `token_ids` would be accepted in a row from here; the state is unchanged."""
        num_valid = 0
        for token in token_ids:
            if not self.accept_token(token):
                break
            num_valid += 1
        self.rollback(num_valid)
        return num_valid


class GrammarState(TokenAcceptor):
    def __init__(self, grammar):
        """`grammar`: a CompiledGrammar (compiler.py), shared read-only between requests."""
        self.grammar = grammar
        self.num_words = (grammar.vocab_size + 31) // 32  # int32 words in a bitmask row
        self.stop_token_ids = grammar.stop_token_ids
        self._matcher = grammar.matcher.deep_copy()
        self.num_tokens = 0  # tokens accepted and not rolled back: the most `rollback` can undo
        self._is_terminated = False
        self._is_stop_uncounted = False  # the stop token ended a complete grammar: the matcher took no step

    @property
    def is_terminated(self) -> bool:
        """A stop token was accepted where the grammar allows one: the constrained output is complete."""
        return self._is_terminated

    def accept_token(self, token_id: int) -> bool:
        """Advance by one emitted token. False (the state unchanged) when the grammar does not allow it
        here: a token outside the mask, or any token once terminated."""
        if self._is_terminated:
            return False
        matcher = self._matcher
        if matcher.is_stopped():  # complete: only a stop token, which the matcher takes as no step
            if token_id not in self.stop_token_ids:
                return False
            self._is_stop_uncounted = True
        elif matcher.validate_tokens([token_id]) != 1 or not matcher.consume_token(token_id):
            return False
        self.num_tokens += 1
        self._is_terminated = token_id in self.stop_token_ids
        return True

    @property
    def library_error(self) -> str:
        """The matcher's own account of why it stopped taking tokens ('' when it has none)."""
        return library_message(self._matcher.get_error()) if self._matcher.is_error() else ""

    def rollback(self, num_tokens: int) -> None:
        """Take back the last `num_tokens` accepted tokens (a terminated state comes back to life when
        its stop token is taken back)."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self.num_tokens} accepted")
        if num_tokens == 0:
            return
        num_steps = num_tokens - 1 if self._is_stop_uncounted else num_tokens
        if num_steps and not self._matcher.rollback(num_steps):
            raise RuntimeError(f"the grammar matcher could not roll back {num_steps} tokens: "
                               f"{self._matcher.get_error()}")
        self.num_tokens -= num_tokens
        self._is_terminated = self._is_stop_uncounted = False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int, draft_token_ids: Sequence[int] = ()) -> None:
        """Write the allowed next tokens into `bitmask[row]` ((B, num_words) int32 on the CPU), and for
        a verify chunk rows row + 1 .. row + k: the masks after each of the k drafts, which must all be
        allowed (validate_tokens). A terminated state's rows allow every token (its sequence has
        ended; nothing it samples is kept)."""
        if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or bitmask.dim() != 2 \
                or bitmask.shape[1] != self.num_words or bitmask.stride(1) != 1:
            raise ValueError(f"the bitmask must be a CPU int32 tensor of shape (rows, {self.num_words}), rows "
                             f"contiguous; got {tuple(bitmask.shape)} {bitmask.dtype} on {bitmask.device}")
        if not 0 <= row or row + len(draft_token_ids) >= bitmask.shape[0]:
            raise ValueError(f"rows {row}..{row + len(draft_token_ids)} do not fit a bitmask of "
                             f"{bitmask.shape[0]} rows")
        num_advanced = 0
        try:
            for j in range(len(draft_token_ids) + 1):
                if self._is_terminated:
                    bitmask[row + j].fill_(-1)
                else:
                    fill_row(self._matcher, bitmask, row + j)
                if j < len(draft_token_ids):
                    if not self.accept_token(draft_token_ids[j]):
                        raise ValueError(f"draft {j} (token {draft_token_ids[j]}) is not allowed by the grammar: "
                                         "cut the drafts with validate_tokens first")
                    num_advanced += 1
        finally:
            self.rollback(num_advanced)


def fill_bitmasks(fills: Sequence[tuple[GrammarState, int, Sequence[int]]], bitmask: torch.Tensor,
                  executor=None) -> None:
    """Fill several states' rows of `bitmask` (each (state, first row, drafts) as in fill_bitmask). With
    the library's `executor` (an llguidance LLExecutor), the rows of states without drafts are filled
    in one call on its thread pool; the others, or all without an executor, in turn."""
    batch = []
    for state, row, drafts in fills:
        if executor is None or drafts or state.is_terminated or not isinstance(state, GrammarState):
            state.fill_bitmask(bitmask, row, drafts)
        else:
            batch.append((state._matcher, row))
    if batch:
        if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not bitmask.is_contiguous():
            raise ValueError(f"the bitmask must be a contiguous CPU int32 tensor; got {bitmask.dtype} on "
                             f"{bitmask.device}")
        if any(not 0 <= row < bitmask.shape[0] for _, row in batch):
            raise ValueError(f"a row outside the bitmask's {bitmask.shape[0]} rows")
        executor.unsafe_compute_mask_ptr(batch, bitmask.data_ptr(), bitmask.shape[1] * bitmask.element_size(),
                                         bitmask.shape[0])
