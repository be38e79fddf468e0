"""Scheduler: continuous batching with a per-step token budget, chunked prefill and preemption.

No prefill/decode phases: running sequences get their next token (or next prefill chunk), then
waiting sequences are admitted with their cached prefix skipped. When blocks run out the newest
running sequence is preempted (blocks freed, recomputed later). After the step, `update_from_output`
applies its sampled rows to the sequences (vLLM v1's split: the output processor does the rest).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from batchgen.engine.config import EngineConfig
from batchgen.engine.core.sequence import Sequence, SequenceStatus
from batchgen.engine.core.waiting_queue import WaitingQueue
from batchgen.engine.kv.kv_cache_manager import KVCacheManager

if TYPE_CHECKING:
    from batchgen.engine.runner.model_runner import StepResult


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    num_draft_tokens: int = 0  # a verify chunk: the last token, then the sequence's drafts (all of them)

    @property
    def is_sampling(self) -> bool:
        """True when this chunk reaches the end of the known tokens (and drafts), so tokens are sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens + self.num_draft_tokens

    @property
    def num_sampled(self) -> int:
        """Positions sampled in this chunk: none, one, or 1 + drafts for a verify chunk (none for a
        prompt-only sequence: it computes its prompt and stops)."""
        return 1 + self.num_draft_tokens if self.is_sampling and not self.seq.is_prompt_only else 0

    def input_token_ids(self) -> list[int]:
        """The chunk's token ids: the sequence's tokens from num_computed_tokens, then its drafts."""
        start = self.seq.num_computed_tokens
        if not self.num_draft_tokens:
            return self.seq.token_ids[start:start + self.num_new_tokens]
        return self.seq.token_ids[start:] + self.seq.draft_token_ids


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    num_preempted: int = 0
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (source, destination): copy on write

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class StepUpdate:
    """What a step's sampled rows did to the sequences (Scheduler.update_from_output), for the output
    processor."""

    # Got tokens, each once in row order (stopped ones too).
    advanced: list[Sequence] = field(default_factory=list)
    # Stopped by a token of this step (the stop rules said so): already out of the scheduler.
    finished: list[Sequence] = field(default_factory=list)
    # A beam's most likely next tokens (token id, logprob), for its group to choose from.
    beam_candidates: list[tuple[Sequence, list[tuple[int, float]]]] = field(default_factory=list)
    # Prompt-only sequences (a scored context's parts) whose prompt is now computed.
    prompts_done: list[Sequence] = field(default_factory=list)
    verifies: list[tuple[int, int]] = field(default_factory=list)  # (drafts, accepted) per verifying sequence
    num_new_tokens: int = 0  # tokens appended (or resolved) in all


def num_accepted(draft_token_ids: list[int], sampled: list[int]) -> int:
    """How many leading drafts equal the tokens sampled at their positions (len(sampled) = 1 + drafts)."""
    accepted = 0
    while accepted < len(draft_token_ids) and draft_token_ids[accepted] == sampled[accepted]:
        accepted += 1
    return accepted


@dataclass
class SchedulerStats:
    num_steps: int = 0
    num_preemptions: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_mixed_steps: int = 0  # steps holding both a prefill chunk and a decode
    num_partial_prefills: int = 0  # prefill chunks that stopped short of the prompt's end
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache at admission
    num_block_copies: int = 0  # blocks copied on write (a fork's first write into a shared block)


class Scheduler:
    def __init__(self, config: EngineConfig, kv_cache_manager: KVCacheManager):
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.waiting = WaitingQueue()
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        now = time.monotonic()
        running_next: list[Sequence] = []
        queue = list(self.running)
        while queue and budget > 0:
            seq = queue.pop(0)
            if seq.num_pending_tokens and seq.is_at_length_limit:
                running_next.append(seq)  # async: its last token is in flight; it finishes when read back
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens + len(seq.draft_token_ids), budget)
            if num_new == 0:  # a beam whose candidates wait for the rest of its group: nothing to run
                running_next.append(seq)
                continue
            # Drafts (speculative decoding) ride on a decode only and never cost a preemption: cut
            # to the budget, dropped when their slots do not fit. The sequence keeps exactly the
            # drafts its chunk verifies.
            num_drafts = max(num_new - 1, 0) if seq.draft_token_ids else 0
            if num_drafts and not self.kv_cache_manager.allocate_slots(seq, num_new):
                num_new, num_drafts = 1, 0
            if len(seq.draft_token_ids) != num_drafts:
                seq.draft_token_ids = seq.draft_token_ids[:num_drafts]
            while not (num_drafts or self.kv_cache_manager.allocate_slots(seq, num_new)):
                victim = queue.pop() if queue else seq  # newest first
                self._preempt(victim)
                out.num_preempted += 1
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, num_new, num_drafts))
                running_next.append(seq)
                budget -= num_new
        running_next.extend(queue)  # out of budget this step; they keep their blocks

        # Admit waiting sequences only when nothing was preempted (the pool is not under pressure).
        # LoRA: a sequence whose adapter would be one more than max_loras among the running ones waits
        # (skipped, keeping its place) while later ones of running adapters or the base are admitted.
        loras = {s.lora_int_id for s in running_next if s.lora_int_id} if self.config.enable_lora else set()
        skipped: list[Sequence] = []
        while (self.waiting and out.num_preempted == 0 and budget > 0
               and len(running_next) < self.config.max_num_seqs):
            seq = self.waiting[0]
            if seq.lora_int_id and seq.lora_int_id not in loras:
                if len(loras) >= self.config.max_loras:
                    skipped.append(self.waiting.popleft())
                    continue
            hits = self.kv_cache_manager.get_computed_blocks(seq)
            num_cached = len(hits) * self.kv_cache_manager.block_size
            num_new = min(seq.num_tokens - num_cached, budget)
            if not self.kv_cache_manager.allocate_slots(seq, num_new, hits):
                break
            self.waiting.popleft()
            seq.num_computed_tokens = num_cached
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = num_cached
                self.stats.num_cached_tokens += num_cached
            if seq.times.first_scheduled_time is None:
                seq.times.first_scheduled_time = now
            seq.status = SequenceStatus.RUNNING
            out.scheduled.append(ScheduledSeq(seq, num_new))
            running_next.append(seq)
            budget -= num_new
            if seq.lora_int_id:
                loras.add(seq.lora_int_id)
        self.waiting.extendleft(reversed(skipped))
        self.running = running_next
        out.blocks_to_copy = self.kv_cache_manager.take_copies()
        self.stats.num_block_copies += len(out.blocks_to_copy)
        self._count(out)
        return out

    def update_after_launch(self, out: SchedulerOutput, sampling: list[ScheduledSeq]) -> None:
        """A step launched ahead (async scheduling): its chunks count as computed now, and each sampling
        sequence's token as pending (a placeholder) until update_from_output reads it back."""
        for s in out.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
        for s in sampling:
            s.seq.add_pending_token()

    def update_from_output(self, out: SchedulerOutput | None, results: list[StepResult],
                           is_stopped: Callable[[Sequence], bool]) -> StepUpdate:
        """Apply a step's sampled rows to their sequences. `out`: the step, when it ran in order (its
        chunks count as computed now); None for one launched ahead (counted at launch, its rows resolve
        the oldest pending tokens).

        A verify chunk keeps the drafts plain decoding agrees with, then its own token there; its
        rejected drafts' positions go back from num_computed_tokens (their KV is overwritten later) and
        the blocks only they reached are freed. Each appended token advances the sample's grammar, then
        `is_stopped` (the output processor's stop rules) says whether the sample ends there: a stopped
        sequence drops the rest of its rows and leaves the scheduler. A beam's row is its candidates,
        for its group to choose from."""
        update = StepUpdate()
        if out is not None:
            for s in out.scheduled:
                s.seq.num_computed_tokens += s.num_new_tokens
        advanced = update.advanced
        num_later_rows = 0
        for i, row in enumerate(results):
            if num_later_rows:  # a verify chunk's rows after its first: taken with it
                num_later_rows -= 1
                continue
            s = row.scheduled
            seq = s.seq
            if seq.status is SequenceStatus.FINISHED:  # finished or aborted with this launched-ahead row in flight
                continue
            if seq.beam is not None:
                update.beam_candidates.append((seq, row.top_logprobs))
                continue
            advanced.append(seq)
            if seq.num_pending_tokens:
                self._resolve(seq, row, is_stopped, update)
            elif s.num_draft_tokens:
                num_later_rows = s.num_draft_tokens
                self._verify(seq, results[i:i + 1 + num_later_rows], is_stopped, update)
            elif self._append(seq, row, is_stopped, update):
                self._stop(seq, update)
        if out is not None:
            update.prompts_done = [s.seq for s in out.scheduled
                                   if s.seq.is_prompt_only and s.seq.num_computed_tokens == s.seq.num_tokens]
        return update

    @staticmethod
    def _append(seq: Sequence, row: StepResult, is_stopped: Callable[[Sequence], bool],
                update: StepUpdate) -> bool:
        """The row's token joins the sequence and advances its grammar; whether the sample stops there."""
        seq.append_token(row.token_id, row.logprob, row.top_logprobs)
        update.num_new_tokens += 1
        if _fail_on_non_finite_logits(seq, row):
            return True
        if seq.grammar is not None and not seq.grammar.accept_token(row.token_id):
            # The library refused a token its own mask allowed (its lexer gave up part-way through a
            # constraint, ...): this sample ends alone with the error; the step's others go on.
            why = seq.grammar.library_error
            seq.finish_reason = "error"
            seq.error = (f"structured output: the grammar refused token {row.token_id}, which its mask allowed"
                         + (f" ({why})" if why else ""))
            return True
        return is_stopped(seq)

    def _verify(self, seq: Sequence, rows: list[StepResult], is_stopped: Callable[[Sequence], bool],
                update: StepUpdate) -> None:
        """A verify chunk's 1 + k rows: the drafts plain decoding agrees with, then its own token there,
        each as a plain row (a stop inside the run ends it where plain decoding would)."""
        drafts = seq.draft_token_ids
        accepted = num_accepted(drafts, [r.token_id for r in rows])
        seq.num_computed_tokens -= len(drafts) - accepted
        seq.num_accepted_tokens += accepted
        update.verifies.append((len(drafts), accepted))
        seq.draft_token_ids = []
        for row in rows[:accepted + 1]:
            if self._append(seq, row, is_stopped, update):
                self._stop(seq, update)
                return
        self.kv_cache_manager.trim(seq)  # blocks only rejected drafts reached go back

    def _resolve(self, seq: Sequence, row: StepResult, is_stopped: Callable[[Sequence], bool],
                 update: StepUpdate) -> None:
        """A launched-ahead row replaces the sequence's oldest pending placeholder; the stop rules then see
        it as an in-order step's token (a later row of a stopped sequence, in flight, is dropped)."""
        later = seq.resolve_pending_token(row.token_id, row.logprob, row.top_logprobs)
        update.num_new_tokens += 1
        if _fail_on_non_finite_logits(seq, row) or is_stopped(seq):
            self._stop(seq, update)
        else:
            self.kv_cache_manager.cache_computed_blocks(seq)  # a block this token completed, as in order
            seq.restore_pending_tokens(later)

    def _stop(self, seq: Sequence, update: StepUpdate) -> None:
        self.finish(seq)
        update.finished.append(seq)

    def running_request_ids(self) -> set[str]:
        """The requests with a sequence in the running batch."""
        return {seq.request_id for seq in self.running if seq.status == SequenceStatus.RUNNING}

    def _preempt(self, seq: Sequence) -> None:
        self.kv_cache_manager.free(seq)
        seq.draft_token_ids = []
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        if seq in self.running:
            self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.stats.num_preemptions += 1

    def _count(self, out: SchedulerOutput) -> None:
        if out.is_empty:
            return
        self.stats.num_steps += 1
        has_prefill = has_decode = False
        for s in out.scheduled:
            # A verify chunk (the last token and its drafts) counts as decode tokens, rejected ones too.
            is_decode = (s.seq.num_computed_tokens >= s.seq.num_prompt_tokens
                         and (s.num_new_tokens == 1 or s.num_draft_tokens > 0))
            if is_decode:
                self.stats.num_decode_tokens += s.num_new_tokens
                has_decode = True
            else:
                self.stats.num_prefill_tokens += s.num_new_tokens
                has_prefill = True
                if not s.is_sampling:
                    self.stats.num_partial_prefills += 1
        self.stats.num_mixed_steps += has_prefill and has_decode

    def abort(self, seq: Sequence) -> None:
        """Take `seq` out wherever it is (waiting or running); its blocks go back."""
        if seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "abort"
        self.kv_cache_manager.free(seq)

    def finish(self, seq: Sequence) -> None:
        """`seq` is done (a stop rule, a beam ended, a scored part computed): its blocks go back (keeping
        their hashes)."""
        if seq.status == SequenceStatus.WAITING:  # a beam or prompt-only part preempted before its end
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
        seq.status = SequenceStatus.FINISHED
        self.kv_cache_manager.free(seq)

    def add_running(self, seq: Sequence) -> None:
        """A fork that holds its parent's blocks (kv_cache_manager.fork) joins the running sequences;
        one without blocks (its parent was preempted) waits, first in line, to be recomputed."""
        if seq.block_ids:
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        else:
            seq.status = SequenceStatus.WAITING
            seq.num_computed_tokens = 0
            self.waiting.appendleft(seq)


def _fail_on_non_finite_logits(seq: Sequence, row: StepResult) -> bool:
    """A row whose logits held NaN (or were all -inf) gives its token a NaN log-probability (raw logit
    minus the row's log-sum-exp): that sample ends alone with the error instead of going on with
    tokens drawn from nothing. Free: the chosen token's log-probability comes back every step."""
    if row.logprob == row.logprob:
        return False
    seq.finish_reason = "error"
    seq.error = (f"the model's logits for this sample were not finite at output token {seq.num_output_tokens} "
                 "(damaged weights, an overflow in float16, or a kernel fault)")
    return True
