"""Scheduler.update_from_output on a small scheduler without a model: hand-made StepResult rows stand in
for the runner, a stop rule for the output processor."""

from __future__ import annotations

import pytest

from batchgen.engine.core.scheduler import Scheduler
from batchgen.engine.core.sequence import PENDING_TOKEN, Sequence, SequenceStatus
from batchgen.engine.runner.model_runner import StepResult
from tests.engine.core.test_scheduler import BLOCK_SIZE, make_scheduler, make_seq


def never(seq: Sequence) -> bool:
    return False


def prefilled(sched: Scheduler, prompt: list[int], max_tokens: int = 16, request_id: str = "r") -> Sequence:
    """A running sequence whose prompt is computed, with one output token (its last step's)."""
    seq = make_seq(request_id, prompt, max_tokens)
    sched.add(seq)
    out = sched.schedule()
    sched.update_from_output(out, [StepResult(out.scheduled[0], 7, -0.5, None)], never)
    return seq


def step(sched: Scheduler, rows: list[tuple[int, float]], is_stopped=never):
    """Schedule once (a single running sequence), give its chunk `rows` (token, logprob)."""
    out = sched.schedule()
    [s] = out.scheduled
    return s, sched.update_from_output(out, [StepResult(s, t, lp, None) for t, lp in rows], is_stopped)


def test_a_plain_row_appends_its_token_and_counts_the_chunk_computed():
    sched = make_scheduler(num_blocks=16)
    seq = prefilled(sched, [1, 2, 3])
    assert seq.output_token_ids == [7] and seq.num_computed_tokens == 3
    s, update = step(sched, [(9, -1.0)])
    assert s.num_new_tokens == 1
    assert seq.output_token_ids == [7, 9] and seq.num_computed_tokens == 4
    assert seq.cumulative_logprob == pytest.approx(-1.5)
    assert update.advanced == [seq] and update.finished == [] and update.num_new_tokens == 1


@pytest.mark.parametrize("sampled, num_kept", [([4, 5, 6, 8], 4), ([4, 5, 9, 8], 3), ([3, 5, 6, 8], 1)])
def test_a_verify_chunk_keeps_the_agreed_drafts_then_the_targets_token(sampled, num_kept):
    sched = make_scheduler(num_blocks=16)
    seq = prefilled(sched, [1, 2])
    seq.draft_token_ids = [4, 5, 6]
    s, update = step(sched, [(t, -0.1) for t in sampled])
    assert s.num_draft_tokens == 3 and s.num_new_tokens == 4
    assert seq.output_token_ids == [7] + sampled[:num_kept]
    # The rejected drafts' positions are not computed: the next chunk starts at the last kept token.
    assert seq.num_computed_tokens == seq.num_tokens - 1
    assert seq.num_accepted_tokens == num_kept - 1 and update.verifies == [(3, num_kept - 1)]
    assert seq.draft_token_ids == [] and update.num_new_tokens == num_kept
    # Blocks past the kept tokens (only rejected drafts reached them) went back: the chunk reached 6
    # positions (2 blocks of 4); one kept token leaves 4 tokens (1 block).
    assert len(seq.block_ids) == -(-seq.num_tokens // BLOCK_SIZE) == (1 if num_kept == 1 else 2)


def test_a_stop_inside_an_accepted_run_drops_the_rest_and_finishes_the_sequence():
    sched = make_scheduler(num_blocks=16)
    seq = prefilled(sched, [1, 2, 3])
    seq.draft_token_ids = [4, 5, 6]
    pool = sched.kv_cache_manager.pool

    def stop_at_5(s: Sequence) -> bool:
        if s.token_ids[-1] == 5:
            s.finish_reason = "stop"
        return s.finish_reason is not None

    _, update = step(sched, [(4, -0.1), (5, -0.1), (6, -0.1), (8, -0.1)], stop_at_5)
    assert seq.output_token_ids == [7, 4, 5]  # where plain decoding would have stopped
    assert update.finished == [seq] and update.advanced == [seq] and update.num_new_tokens == 2
    assert seq.status == SequenceStatus.FINISHED and seq.block_ids == [] and seq not in sched.running
    assert pool.num_free_blocks == pool.num_blocks


def test_launched_ahead_rows_resolve_the_oldest_pending_tokens_and_rows_of_stopped_ones_are_dropped():
    sched = make_scheduler(num_blocks=16)
    seq = prefilled(sched, [1, 2, 3])
    launched = []
    for _ in range(2):  # two steps launched, neither read back
        out = sched.schedule()
        sched.update_after_launch(out, out.scheduled)
        launched.append(out.scheduled[0])
    assert seq.token_ids[-2:] == [PENDING_TOKEN, PENDING_TOKEN] and seq.num_pending_tokens == 2
    assert seq.num_computed_tokens == 5 and seq.output_token_ids == [7]

    def stop_at_11(s: Sequence) -> bool:
        assert s.token_ids[-1] != PENDING_TOKEN  # the rules see the token just read back as the last
        if s.token_ids[-1] == 11:
            s.finish_reason = "stop"
        return s.finish_reason is not None

    update = sched.update_from_output(None, [StepResult(launched[0], 10, -0.2, None)], stop_at_11)
    assert seq.output_token_ids == [7, 10] and seq.num_pending_tokens == 1 and update.finished == []
    update = sched.update_from_output(None, [StepResult(launched[1], 11, -0.2, None)], stop_at_11)
    assert seq.output_token_ids == [7, 10, 11] and seq.num_pending_tokens == 0
    assert update.finished == [seq] and seq.is_finished
    # A row still in flight for a sequence that stopped (or was aborted) meanwhile changes nothing.
    update = sched.update_from_output(None, [StepResult(launched[1], 12, -0.2, None)], stop_at_11)
    assert seq.output_token_ids == [7, 10, 11] and update.advanced == [] and update.num_new_tokens == 0


def test_a_beams_row_is_its_candidates_and_a_prompt_only_part_is_done_when_its_prompt_is_computed():
    sched = make_scheduler(num_blocks=16)
    beam = prefilled(sched, [1, 2, 3], request_id="beam")
    beam.beam = object()  # any group: update_from_output only hands its candidates on
    part = make_seq("part", [4, 5, 6, 7, 8], 1)
    part.is_prompt_only = True
    sched.add(part)
    out = sched.schedule()
    beam_chunk = next(s for s in out.scheduled if s.seq is beam)
    candidates = [(9, -0.1), (10, -2.0)]
    update = sched.update_from_output(out, [StepResult(beam_chunk, 9, -0.1, candidates)], never)
    assert beam.output_token_ids == [7]  # its group chooses its next token
    assert update.beam_candidates == [(beam, candidates)] and update.advanced == []
    assert update.prompts_done == [part] and part.num_computed_tokens == 5


def test_a_token_its_grammar_refuses_ends_that_sample_with_an_error():
    class Refusing:
        library_error = "lexer out of fuel"

        def accept_token(self, token_id: int) -> bool:
            return False

    sched = make_scheduler(num_blocks=16)
    seq = prefilled(sched, [1, 2, 3])
    seq.grammar = Refusing()
    step(sched, [(9, -1.0)])  # the step goes on: only this sample ends
    assert seq.is_finished and seq.finish_reason == "error"
    assert "refused token 9" in seq.error and "lexer out of fuel" in seq.error


def test_scheduled_seq_rows_of_other_sequences_are_applied_in_order():
    sched = make_scheduler(num_blocks=16)
    a = make_seq("a", [1, 2], 8)
    b = make_seq("b", [3, 4, 5], 8)
    for seq in (a, b):
        sched.add(seq)
    out = sched.schedule()
    rows = [StepResult(s, 20 + i, -0.1, None) for i, s in enumerate(out.scheduled)]
    update = sched.update_from_output(out, rows, never)
    assert [seq.output_token_ids for seq in (a, b)] == [[20], [21]]
    assert update.advanced == [a, b] and sched.running_request_ids() == {"a", "b"}
