"""A verify chunk's rows are sampled as plain decoding samples those positions: the penalty counts
include the earlier drafts, min_tokens bans and keyed draws sit at each row's own output position,
only the kept tokens join the device-side counts, and the rejected position's KV is overwritten.
Tiny random models (step_fixtures.py): the bundled model is not the point here.
"""

from __future__ import annotations

import pytest
import torch

from batchgen.engine.core.scheduler import ScheduledSeq
from batchgen.engine.runner.step_inputs import StepPacker
from batchgen.engine.sampling import sampler as sampler_module
from batchgen.engine.sampling.sampler import Sampler, apply_penalties
from batchgen.engine.sampling.sampling_batch import PenaltyState, add_sampling_sections
from batchgen.engine.sampling.sampling_params import SamplingParams
from tests.engine.sampling.test_keyed_random import (
    TEMPERATURE,
    TOP_P,
    chi_square_p_value,
    processed_distribution,
)
from tests.engine.sampling.test_sampler import EOS, VOCAB
from tests.engine.sampling.test_sampler import make_seq as sampler_seq
from tests.engine.step_fixtures import VOCAB as TINY_VOCAB
from tests.engine.step_fixtures import advance, decode, make_seq, prefill, tiny_runner

DRAFTS = [5, 9, 5]


def verify_rows(seq, drafts):
    """The rows of a verify chunk of `seq` with `drafts`: (row seqs, offsets)."""
    seq.draft_token_ids = list(drafts)
    return [seq] * (1 + len(drafts)), list(range(1 + len(drafts)))


def test_penalties_at_each_row_count_the_drafts_before_it():
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(VOCAB, generator=gen) * 0.1).expand(4, VOCAB).clone()  # the same row 4 times
    logits[:, [5, 9, 12]] += torch.tensor([6.0, 5.0, 4.0])  # likely tokens: the penalties decide between them
    params = SamplingParams(temperature=0, repetition_penalty=1.8, frequency_penalty=0.7, presence_penalty=0.4)
    seq = sampler_seq(params, output=[7, 5])
    seqs, offsets = verify_rows(seq, DRAFTS)
    tokens, _ = Sampler(eos_token_ids=(EOS,))(logits.clone(), seqs, offsets)
    expected = []
    for j in range(4):  # plain decoding at position j: the drafts before it are output tokens
        plain = sampler_seq(params, output=[7, 5] + DRAFTS[:j])
        expected.append(int(apply_penalties(logits[j:j + 1].clone(), [plain]).argmax()))
    assert tokens == expected
    assert len(set(expected)) > 1  # only the drafts before each row differ between rows


def test_min_tokens_bans_and_draw_positions_are_each_rows_own():
    params = SamplingParams(temperature=0.8, min_tokens=4, stop_token_ids=[11], seed=1)
    seq = sampler_seq(params, output=[7, 5])  # 2 output tokens: rows at positions 2, 3, 4, 5
    seqs, offsets = verify_rows(seq, DRAFTS)
    packer = StepPacker(torch.device("cpu"))
    batch = add_sampling_sections(packer, seqs, (EOS,), VOCAB, PenaltyState(VOCAB, torch.device("cpu")), offsets)
    tensors = packer.send()
    assert tensors["s.random_position"].tolist() == [2, 3, 4, 5]
    # Positions 2 and 3 are below min_tokens: EOS and the stop token banned in rows 0 and 1 only.
    assert sorted(zip(tensors["s.ban_index"].tolist(), tensors["s.ban_tokens"].tolist())) == \
        [(0, 11), (0, EOS), (1, 11), (1, EOS)]
    assert batch.num_rows == 4


def verify_draws(num_rounds: int, k: int, position_blind: bool = False) -> torch.Tensor:
    """200 sequences, `num_rounds` verify chunks of 1 + k rows each: every row's token counted."""
    row = torch.randn(VOCAB, generator=torch.Generator().manual_seed(21)) * 2
    seqs = [sampler_seq(SamplingParams(temperature=TEMPERATURE, top_p=TOP_P, seed=4), request_id=f"r{i}")
            for i in range(200)]
    sampler = Sampler(eos_token_ids=(EOS,))
    draws = []
    for _ in range(num_rounds):
        rows, offsets = [], []
        for seq in seqs:
            seq_rows, seq_offsets = verify_rows(seq, [1] * k)
            rows += seq_rows
            offsets += [0] * len(seq_offsets) if position_blind else seq_offsets
        tokens, _ = sampler(row.expand(len(rows), VOCAB).clone(), rows, offsets)
        draws += tokens
        for i, seq in enumerate(seqs):  # as if all were kept: the next round starts k + 1 further
            seq.token_ids.extend(tokens[i * (k + 1):(i + 1) * (k + 1)])
    return torch.bincount(torch.tensor(draws), minlength=VOCAB), processed_distribution(row)


def test_verify_rows_draw_the_processed_distribution_chi_square():
    counts, expected = verify_draws(num_rounds=25, k=3)  # 200 x 25 x 4 = 20,000 draws
    assert counts.sum() == 20_000 and counts[expected == 0].sum() == 0
    assert chi_square_p_value(counts, expected) >= 0.001


def test_verify_rows_that_shared_one_position_would_fail_it():
    counts, expected = verify_draws(num_rounds=25, k=3, position_blind=True)  # each draw repeated 4 times
    assert chi_square_p_value(counts, expected) < 0.001


def test_a_sampler_that_ignores_top_p_fails_it_at_verify_rows(monkeypatch):
    real_filter = sampler_module.filter_logits
    monkeypatch.setattr(sampler_module, "filter_logits",
                        lambda logits, top_k, top_p, min_p, **flags: real_filter(logits, top_k, torch.ones_like(top_p),
                                                                                  min_p, **flags))
    counts, expected = verify_draws(num_rounds=25, k=3)
    assert chi_square_p_value(counts, expected) < 0.001


PARAMS = [SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.5, frequency_penalty=0.8),
          SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=16, repetition_penalty=1.3),
          SamplingParams(temperature=0, max_tokens=16, logprobs=2)]


def plain_decode(num_decodes: int):
    """Prefill then `num_decodes` decode steps: per sequence, its tokens and (logprob, top) per token."""
    runner = tiny_runner(torch.device("cpu"))
    seqs = [make_seq(f"r{i}", [3 + i, 8, 1, 4, 2], p, first_block=1 + 4 * i) for i, p in enumerate(PARAMS)]
    advance(runner.execute(prefill(seqs)))
    rows = {seq.request_id: [] for seq in seqs}
    for _ in range(num_decodes):
        results = runner.execute(decode(seqs))
        for r in results:
            rows[r.scheduled.seq.request_id].append((r.token_id, r.logprob, r.top_logprobs))
        advance(results)
    return runner, seqs, rows


@pytest.mark.parametrize("num_right", [3, 1])
def test_a_verify_chunk_keeps_what_plain_decoding_emits_and_rolls_back(num_right):
    """Drafts: `num_right` of plain decoding's tokens, then a wrong one. The rows up to the first
    wrong draft sample plain decoding's tokens; the penalty counts hold the kept tokens only; after
    the rollback the next decode (over the rejected position's overwritten KV) matches plain decoding."""
    _, plain_seqs, plain_rows = plain_decode(num_decodes=num_right + 2)
    runner = tiny_runner(torch.device("cpu"))
    seqs = [make_seq(f"r{i}", [3 + i, 8, 1, 4, 2], p, first_block=1 + 4 * i) for i, p in enumerate(PARAMS)]
    advance(runner.execute(prefill(seqs)))
    scheduled = []
    for seq in seqs:
        right = [t for t, _, _ in plain_rows[seq.request_id][:num_right]]
        wrong = (plain_rows[seq.request_id][num_right][0] + 1) % TINY_VOCAB
        seq.draft_token_ids = right + [wrong]
        scheduled.append(ScheduledSeq(seq, 1 + len(seq.draft_token_ids), len(seq.draft_token_ids)))
    results = runner.execute(scheduled)
    assert len(results) == len(seqs) * (num_right + 2)
    for seq in seqs:
        rows = [r for r in results if r.scheduled.seq is seq]
        expected = plain_rows[seq.request_id][:num_right + 1]  # the accepted drafts, then plain's own token
        assert [r.token_id for r in rows[:num_right + 1]] == [t for t, _, _ in expected]
        for r, (_, plain_logprob, plain_top) in zip(rows, expected):
            assert r.logprob == pytest.approx(plain_logprob, abs=1e-4)
            assert (r.top_logprobs is None) == (plain_top is None)
            if r.top_logprobs is not None:
                assert [t for t, _ in r.top_logprobs] == [t for t, _ in plain_top]
        # What the engine does: keep num_right drafts + the target's token, roll back the rest.
        num_rejected = len(seq.draft_token_ids) - num_right
        seq.num_computed_tokens += 1 + len(seq.draft_token_ids) - num_rejected
        seq.token_ids.extend(t for t, _, _ in expected)
        seq.draft_token_ids = []
    for seq in seqs:  # only the kept tokens joined the counts
        if seq.params.has_penalties:
            row = runner.penalties.rows[seq]
            kept = torch.bincount(torch.tensor(seq.output_token_ids), minlength=TINY_VOCAB).to(torch.int32)
            assert torch.equal(runner.penalties.output_counts[row], kept)
    results = runner.execute(decode(seqs))
    for r in results:
        assert r.token_id == plain_rows[r.scheduled.seq.request_id][num_right + 1][0]
        r.scheduled.seq.token_ids.append(r.token_id)
    assert [seq.output_token_ids for seq in seqs] == [p.output_token_ids for p in plain_seqs]
