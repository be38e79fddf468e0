"""The sampler's per-step inputs as device tensors, and the penalties' device-side token counts.

The host decides once per step which rows need which treatment (it knows every SamplingParams), so
the sampler never asks the device (`.any()`, `.item()`) whether a row needs top-k or a penalty. The
per-row values travel in the step's one packed copy (step_inputs.py), as sections added here.

Penalties read per-sequence token counts that live on the device (PenaltyState): a sequence gets a
row when it first samples with a penalty (its prompt and any output tokens are uploaded once, in
that step's packed copy), and after every step the sampled tokens are added on the device. Nothing
is re-uploaded per step; the row is given back when the sequence finishes or is aborted.

A verify chunk (speculative decoding) samples 1 + k rows of one sequence, row j as plain decoding
would once the first j drafts were its tokens: its keyed draw's position and its min_tokens ban are
those of output position `num_output_tokens + j`, and its penalties see the counts plus the first j
drafts (a per-step delta of (row, token) pairs, the device counts untouched). After sampling, only
the rows the engine will keep (those up to the first sampled token that differs from its draft) add
their tokens to the counts, judged on the device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from batchgen.engine.core.sequence import Sequence
from batchgen.engine.decoding.structured.step_bitmask import GrammarFill
from batchgen.engine.runner.step_inputs import StepPacker, float_section, int_section

# The widest candidate set the sampler takes per random row: a bounded top-k up to this is drawn from
# its k largest logits; rows filtered by top-p / min-p alone take this many and fall back to the whole
# row only when their kept set reaches past it (a nucleus of > 1024 tokens: near-flat distributions).
MAX_CANDIDATES = 1024


@dataclass
class SamplingBatch:
    """One row per sampling sequence, in batch order. Index tensors point into those N rows."""

    num_rows: int
    # Random rows (temperature > 0): host list, and per random row its parameters.
    random_rows: list[int] = field(default_factory=list)
    random_index: torch.Tensor | None = None  # (R,) int32
    temperature: torch.Tensor | None = None  # (R,) float32
    top_k: torch.Tensor | None = None  # (R,) int32 (vocab: off)
    top_p: torch.Tensor | None = None  # (R,) float32
    min_p: torch.Tensor | None = None  # (R,) float32
    random_key_lo: torch.Tensor | None = None  # (R,) int32: low and high words of the sample's 63-bit key
    random_key_hi: torch.Tensor | None = None  # (R,) int32
    random_position: torch.Tensor | None = None  # (R,) int32: the output position being sampled (a
    # verify chunk's row j: the sequence's output length + j)
    has_top_k_or_p: bool = False
    has_min_p: bool = False
    # The sampler's candidates (sampler.py): K, the width of each random row's largest-K set it draws
    # from (0: no row filters, every draw is dense); whether every row's kept set is known to lie in
    # it (all bounded by a top-k <= K, or K the whole vocabulary); whether a row's top-p is measured
    # against its whole distribution (no bounded top-k), which needs each row's full normalizer.
    num_candidates: int = 0
    is_candidate_set_exact: bool = False
    needs_full_mass: bool = False
    # Rows with penalties: their PenaltyState rows and values.
    penalty_index: torch.Tensor | None = None  # (P,) int32 into the N rows
    penalty_rows: torch.Tensor | None = None  # (P,) int32 into PenaltyState
    repetition: torch.Tensor | None = None  # (P,) float32
    presence: torch.Tensor | None = None  # (P,) float32
    frequency: torch.Tensor | None = None  # (P,) float32
    has_repetition: bool = False
    # Verify chunks' penalty rows: the drafts before each row (per-row count deltas), and what decides
    # which rows' tokens are kept (recorded): each penalty row's draft and its sequence's first row.
    draft_count_index: torch.Tensor | None = None  # (D,) int32 into the P penalty rows
    draft_count_tokens: torch.Tensor | None = None  # (D,) int32
    penalty_draft: torch.Tensor | None = None  # (P,) int32: the draft the row's token is checked against; -1: none
    penalty_first: torch.Tensor | None = None  # (P,) int32: index (into P) of the row's sequence's first row
    # PenaltyState rows that start this step: cleared, then filled with these (row, token) pairs.
    new_penalty_rows: torch.Tensor | None = None  # (K,) int32
    prompt_rows: torch.Tensor | None = None  # (M,) int32 (prompt tokens: only for a repetition penalty)
    prompt_tokens: torch.Tensor | None = None  # (M,) int32
    output_rows: torch.Tensor | None = None  # (M',) int32 (output tokens so far, counted)
    output_tokens: torch.Tensor | None = None  # (M',) int32
    # min_tokens: (row, token) pairs banned to -inf.
    ban_index: torch.Tensor | None = None  # (B,) int32
    ban_tokens: torch.Tensor | None = None  # (B,) int32
    # Top-N logprobs: rows that ask, and N per row (host).
    top_index: torch.Tensor | None = None  # (L,) int32
    top_counts: list[int] = field(default_factory=list)  # (N,) host: N per row, 0 = none
    # Structured output: the constrained rows (a verify chunk's each), and per constrained sequence
    # its state, first bitmask row and drafts (host): the runner fills and applies the mask.
    grammar_rows: torch.Tensor | None = None  # (R,) int32 into the N rows
    grammar_fills: list[GrammarFill] = field(default_factory=list)

    @property
    def has_penalties(self) -> bool:
        return self.penalty_index is not None

    @property
    def max_top_logprobs(self) -> int:
        return max(self.top_counts, default=0)

    def random_keys(self) -> torch.Tensor:
        """(R,) int64: each random row's sample key, put back together from its two int32 words."""
        return (self.random_key_hi.long() << 32) | (self.random_key_lo.long() & 0xFFFFFFFF)


class PenaltyState:
    """Per-sequence token counts on the device: output token counts and the prompt's token set."""

    def __init__(self, vocab_size: int, device: torch.device, initial_rows: int = 16):
        self.vocab_size = vocab_size
        self.device = device
        self.initial_rows = initial_rows
        self.output_counts: torch.Tensor | None = None  # (capacity, V) int32, made on first use
        self.prompt_mask: torch.Tensor | None = None  # (capacity, V) bool
        self.rows: dict[Sequence, int] = {}
        self.free_rows: list[int] = []

    @property
    def capacity(self) -> int:
        return 0 if self.output_counts is None else self.output_counts.shape[0]

    def row_for(self, seq: Sequence) -> tuple[int, bool]:
        """(row, is_new): the sequence's row, taking a free one (growing the tables) when it has none."""
        row = self.rows.get(seq)
        if row is not None:
            return row, False
        if not self.free_rows:
            self._grow()
        row = self.free_rows.pop()
        self.rows[seq] = row
        return row, True

    def release(self, seq: Sequence) -> None:
        row = self.rows.pop(seq, None)
        if row is not None:
            self.free_rows.append(row)

    def _grow(self) -> None:
        old = self.capacity
        new = max(self.initial_rows, 2 * old)
        counts = torch.zeros((new, self.vocab_size), dtype=torch.int32, device=self.device)
        mask = torch.zeros((new, self.vocab_size), dtype=torch.bool, device=self.device)
        if old:
            counts[:old] = self.output_counts
            mask[:old] = self.prompt_mask
        self.output_counts, self.prompt_mask = counts, mask
        self.free_rows.extend(range(new - 1, old - 1, -1))  # lowest row first

    def initialize(self, batch: SamplingBatch) -> None:
        """Clear this step's new rows and fill them from their prompt and output tokens (device ops)."""
        if batch.new_penalty_rows is None:
            return
        rows = batch.new_penalty_rows.long()
        self.output_counts.index_fill_(0, rows, 0)
        self.prompt_mask.index_fill_(0, rows, False)
        if batch.prompt_rows is not None:
            self.prompt_mask.index_put_((batch.prompt_rows.long(), batch.prompt_tokens.long()),
                                        torch.ones((), dtype=torch.bool, device=self.device))
        if batch.output_rows is not None:
            tokens = batch.output_tokens.long()
            self.output_counts.index_put_((batch.output_rows.long(), tokens),
                                          torch.ones_like(tokens, dtype=torch.int32), accumulate=True)

    def apply(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Penalized logits (a new tensor): vLLM's repetition penalty over prompt and output tokens,
        presence and frequency penalties over output tokens."""
        logits = logits.clone()
        index = batch.penalty_index.long()
        rows = batch.penalty_rows.long()
        picked = logits.index_select(0, index)  # (P, V)
        counts = self.output_counts.index_select(0, rows)  # (P, V) int32, a copy
        if batch.draft_count_index is not None:  # verify rows: the drafts before each row count too
            tokens = batch.draft_count_tokens.long()
            counts.index_put_((batch.draft_count_index.long(), tokens), torch.ones_like(tokens, dtype=torch.int32),
                              accumulate=True)
        counts = counts.to(picked.dtype)
        is_output = counts > 0
        if batch.has_repetition:
            seen = self.prompt_mask.index_select(0, rows) | is_output
            rep = batch.repetition[:, None]
            penalized = torch.where(picked > 0, picked / rep, picked * rep)
            picked = torch.where(seen, penalized, picked)
        picked = picked - (batch.frequency[:, None] * counts + batch.presence[:, None] * is_output.to(picked.dtype))
        logits.index_copy_(0, index, picked)
        return logits

    def record(self, tokens: torch.Tensor, batch: SamplingBatch) -> None:
        """Add this step's sampled tokens (N,) to their rows' output counts (device ops). A verify
        chunk's row counts only when every earlier row of its sequence sampled its draft (the tokens
        Scheduler.update_from_output keeps: the accepted drafts, then the first token that differs or the bonus)."""
        if batch.penalty_index is None:
            return
        chosen = tokens.index_select(0, batch.penalty_index.long())  # (P,)
        if batch.penalty_draft is None:
            weights = torch.ones_like(chosen, dtype=torch.int32)
        else:
            # Rejections before each row within its sequence: an inclusive running count, minus the
            # row's own, minus what came before the sequence's first row.
            rejected = (chosen != batch.penalty_draft.long()).to(torch.int32)  # (P,)
            before = rejected.cumsum(0) - rejected  # (P,) exclusive prefix count
            weights = (before == before.index_select(0, batch.penalty_first.long())).to(torch.int32)
        self.output_counts.index_put_((batch.penalty_rows.long(), chosen), weights, accumulate=True)


def _int32_words(value: int) -> tuple[int, int]:
    """A 64-bit key as its (low, high) 32-bit words, each as the signed int32 the buffer holds."""
    lo, hi = value & 0xFFFFFFFF, (value >> 32) & 0xFFFFFFFF
    return lo - (1 << 32) if lo >= 1 << 31 else lo, hi - (1 << 32) if hi >= 1 << 31 else hi


# The sampler's sections, declared once: each dataclass is a group sent together (when it has rows), its
# fields named as SamplingBatch's device fields, which `attach_sampling_tensors` points at the sent copy.
@dataclass
class RandomSections:
    """Rows with temperature > 0."""

    random_index: list[int] = int_section()
    temperature: list[float] = float_section()
    top_k: list[int] = int_section()
    top_p: list[float] = float_section()
    min_p: list[float] = float_section()
    random_key_lo: list[int] = int_section()
    random_key_hi: list[int] = int_section()
    random_position: list[int] = int_section()


@dataclass
class PenaltySections:
    """Rows with a repetition, presence or frequency penalty."""

    penalty_index: list[int] = int_section()
    penalty_rows: list[int] = int_section()
    repetition: list[float] = float_section()
    presence: list[float] = float_section()
    frequency: list[float] = float_section()


@dataclass
class VerifyPenaltySections:
    """Per penalty row: the draft its token is checked against (-1: none) and its sequence's first row;
    sent only when a verify chunk has penalties."""

    penalty_draft: list[int] = int_section()
    penalty_first: list[int] = int_section()


@dataclass
class DraftCountSections:
    draft_count_index: list[int] = int_section()
    draft_count_tokens: list[int] = int_section()


@dataclass
class NewPenaltyRowSections:
    new_penalty_rows: list[int] = int_section()


@dataclass
class PromptTokenSections:
    prompt_rows: list[int] = int_section()
    prompt_tokens: list[int] = int_section()


@dataclass
class OutputTokenSections:
    output_rows: list[int] = int_section()
    output_tokens: list[int] = int_section()


@dataclass
class BanSections:
    ban_index: list[int] = int_section()
    ban_tokens: list[int] = int_section()


@dataclass
class TopLogprobSections:
    top_index: list[int] = int_section()


@dataclass
class GrammarSections:
    """Rows with a structured-output constraint: the logits row each bitmask row masks."""

    grammar_rows: list[int] = int_section()


SECTION_GROUPS = (RandomSections, PenaltySections, VerifyPenaltySections, DraftCountSections,
                  NewPenaltyRowSections, PromptTokenSections, OutputTokenSections, BanSections, TopLogprobSections,
                  GrammarSections)


def _has_rows(group) -> bool:
    return len(getattr(group, dataclasses.fields(group)[0].name)) > 0


def add_sampling_sections(packer: StepPacker, seqs: list[Sequence], eos_token_ids: tuple[int, ...],
                          vocab_size: int, penalties: PenaltyState,
                          draft_offsets: list[int] | None = None) -> SamplingBatch:
    """Add the sampling sections of `seqs` (one per sampling row) to the step's packer. Returns the
    batch with its host fields set; `attach_sampling_tensors` fills in the device tensors.

    `draft_offsets[i]` (verify chunks): row i samples the position that many drafts past its
    sequence's end (a sequence's rows consecutive, offsets 0..k, its `draft_token_ids` the k drafts
    its chunk verifies); None: every row at offset 0."""
    batch = SamplingBatch(num_rows=len(seqs))
    offsets = draft_offsets if draft_offsets is not None else [0] * len(seqs)
    rnd, pen, verify, drafted = RandomSections(), PenaltySections(), VerifyPenaltySections(), DraftCountSections()
    new, prompt, output = NewPenaltyRowSections(), PromptTokenSections(), OutputTokenSections()
    ban, top, grammar = BanSections(), TopLogprobSections(), GrammarSections()
    top_counts = [0] * len(seqs)
    num_candidates, is_exact = 0, True
    for i, (seq, offset) in enumerate(zip(seqs, offsets)):
        p = seq.params
        position = seq.num_output_tokens + offset  # the output position this row samples
        if seq.grammar is not None:
            if offset == 0:  # the sequence's first row: it fills this row and one per draft
                drafts = seq.draft_token_ids if draft_offsets is not None else ()
                batch.grammar_fills.append((seq.grammar, len(grammar.grammar_rows), drafts))
            grammar.grammar_rows.append(i)
        num_top = seq.num_top_logprobs  # the request's logprobs N, or a beam's candidates
        if (p.temperature == 0.0 and not num_top and p.repetition_penalty == 1.0 and p.presence_penalty == 0.0
                and p.frequency_penalty == 0.0 and (p.min_tokens == 0 or position >= p.min_tokens)):
            continue  # plain greedy: nothing to send (the common case at large batch)
        if p.temperature != 0.0:
            k = vocab_size if p.top_k == -1 else min(p.top_k, vocab_size)
            lo, hi = _int32_words(seq.random_key)
            rnd.random_index.append(i)
            rnd.temperature.append(p.temperature)
            rnd.top_k.append(k)
            rnd.top_p.append(p.top_p)
            rnd.min_p.append(p.min_p)
            rnd.random_key_lo.append(lo)
            rnd.random_key_hi.append(hi)
            rnd.random_position.append(position)
            batch.has_top_k_or_p |= k < vocab_size or p.top_p < 1
            batch.has_min_p |= p.min_p > 0
            if k <= MAX_CANDIDATES:
                num_candidates = max(num_candidates, k)
            elif k == vocab_size and (p.top_p < 1 or p.min_p > 0):
                num_candidates, is_exact = MAX_CANDIDATES, False
                batch.needs_full_mass |= p.top_p < 1
            else:  # unfiltered, or a top-k past MAX_CANDIDATES: drawn from the whole row
                is_exact = False
        if p.has_penalties:
            row, is_new = penalties.row_for(seq)
            # A verify chunk's rows: the drafts before this one count, and the row's token is kept
            # only while the rows before it (from its sequence's first, offset 0) sampled their drafts.
            drafts = seq.draft_token_ids
            if offset:
                drafted.draft_count_index.extend([len(pen.penalty_index)] * offset)
                drafted.draft_count_tokens.extend(drafts[:offset])
            verify.penalty_first.append(len(pen.penalty_index) - offset)
            verify.penalty_draft.append(drafts[offset] if draft_offsets is not None and offset < len(drafts) else -1)
            pen.penalty_index.append(i)
            pen.penalty_rows.append(row)
            pen.repetition.append(p.repetition_penalty)
            pen.presence.append(p.presence_penalty)
            pen.frequency.append(p.frequency_penalty)
            batch.has_repetition |= p.repetition_penalty != 1.0
            if is_new:
                new.new_penalty_rows.append(row)
                if p.repetition_penalty != 1.0:
                    prompt.prompt_rows.extend([row] * seq.num_prompt_tokens)
                    prompt.prompt_tokens.extend(seq.prompt_token_ids)
                outputs = seq.output_token_ids  # none unless the row was lost; kept for safety
                output.output_rows.extend([row] * len(outputs))
                output.output_tokens.extend(outputs)
        if position < p.min_tokens:
            banned = list(eos_token_ids) + p.stop_token_ids
            ban.ban_index.extend([i] * len(banned))
            ban.ban_tokens.extend(banned)
        if num_top:
            top.top_index.append(i)
            top_counts[i] = num_top
    batch.random_rows, batch.top_counts = rnd.random_index, top_counts
    if batch.has_top_k_or_p or batch.has_min_p:
        batch.num_candidates = min(num_candidates, vocab_size)
        batch.is_candidate_set_exact = is_exact or batch.num_candidates == vocab_size
    is_verify_with_penalties = any(d >= 0 for d in verify.penalty_draft)
    for group in (rnd, pen, drafted, new, prompt, output, ban, top, grammar):
        if _has_rows(group):
            packer.add_sections(group, "s.")
    if is_verify_with_penalties:
        packer.add_sections(verify, "s.")
    return batch


def attach_sampling_tensors(batch: SamplingBatch, tensors: dict[str, torch.Tensor]) -> SamplingBatch:
    """Point the batch's device fields at the sent sections (absent sections stay None)."""
    for name, t in tensors.items():
        if name.startswith("s."):
            setattr(batch, name[2:], t)
    return batch


def sampling_batch_for(seqs: list[Sequence], eos_token_ids: tuple[int, ...], vocab_size: int,
                       penalties: PenaltyState, device: torch.device,
                       draft_offsets: list[int] | None = None) -> SamplingBatch:
    """A SamplingBatch of its own (one packed copy for the sampler alone): for callers outside a step."""
    packer = StepPacker(device)
    batch = add_sampling_sections(packer, seqs, eos_token_ids, vocab_size, penalties, draft_offsets)
    return attach_sampling_tensors(batch, packer.send())
