"""The sampler's candidate draws (top-K by torch.topk, no sort of the vocabulary) against the dense
definition: the same kept sets as the sorting filter, the same tokens as the dense race over the
filtered distribution, rows whose kept set reaches past the candidates redrawn from their whole row,
and a row's token independent of what its batch mates ask (which sets K).

A vocabulary of 400 with MAX_CANDIDATES lowered to 64 puts every case in reach at toy size: bounded
top-k rows, top-p / min-p rows covered by their 64 candidates (peaked rows) or not (flat rows), a
top-k past the candidates, and unfiltered rows in the same batch.
"""

from __future__ import annotations

import pytest
import torch

from batchgen.engine.sampling import sampling_batch
from batchgen.engine.sampling.keyed_random import keyed_exponential
from batchgen.engine.sampling.sampler import Sampler, candidates_cover, filter_logits
from batchgen.engine.sampling.sampling_batch import PenaltyState, sampling_batch_for
from batchgen.engine.sampling.sampling_params import SamplingParams
from batchgen.kernels import cpu_sampling
from tests.engine.sampling.test_sampler import EOS, make_seq

VOCAB = 400
MAX_CANDIDATES = 64
# (top_k, top_p, min_p) per row kind; -1: off.
ROW_KINDS = [(5, 1.0, 0.0), (40, 0.9, 0.0), (64, 0.8, 0.05), (-1, 0.9, 0.0), (-1, 1.0, 0.1), (-1, 0.7, 0.02),
             (100, 0.9, 0.0), (-1, 1.0, 0.0)]


@pytest.fixture(autouse=True)
def small_candidate_sets(monkeypatch):
    monkeypatch.setattr(sampling_batch, "MAX_CANDIDATES", MAX_CANDIDATES)


def mixed_logits(num_rows: int, seed: int) -> torch.Tensor:
    """Rows alternately peaked (a few dominant tokens: kept sets well inside 64) and flat (kept sets of
    hundreds of tokens), so both sides of every coverage test occur."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, VOCAB, generator=gen)
    peaked = torch.arange(num_rows) % 2 == 0
    logits[peaked] *= 4.0
    return logits


def dense_reference(logits: torch.Tensor, seqs, temperature: float) -> list[int]:
    """The definition: temper, filter by sorting the whole row (filter_logits' dense path), softmax, and
    the exponential race with the dense keyed noise."""
    tokens = []
    for row, seq in zip(logits, seqs):
        p = seq.params
        k = torch.tensor([VOCAB if p.top_k == -1 else p.top_k])
        probs = filter_logits(row[None] / temperature, k, torch.tensor([p.top_p]), torch.tensor([p.min_p])).softmax(-1)
        noise = keyed_exponential(torch.tensor([seq.random_key]), torch.tensor([seq.num_output_tokens]), VOCAB)
        tokens.append(int((probs / noise).argmax()))
    return tokens


def sample(logits: torch.Tensor, seqs, is_c_sampling: bool = False) -> tuple[list[int], sampling_batch.SamplingBatch]:
    sampler = Sampler(eos_token_ids=(EOS,), is_c_sampling=is_c_sampling)
    penalties = PenaltyState(VOCAB, logits.device)
    batch = sampling_batch_for(seqs, sampler.eos_token_ids, VOCAB, penalties, logits.device)
    return sampler.sample(logits.clone(), batch, seqs, penalties).tokens.tolist(), batch


def kind_seqs(num_rows: int, temperature: float = 0.9):
    seqs = []
    for i in range(num_rows):
        top_k, top_p, min_p = ROW_KINDS[i % len(ROW_KINDS)]
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=3)
        seqs.append(make_seq(params, request_id=f"r{i}"))
    return seqs


def test_sorted_candidates_keep_exactly_the_dense_filters_set():
    logits = mixed_logits(64, seed=1) / 0.9
    top_k = torch.tensor([VOCAB if kind[0] == -1 else kind[0] for kind in ROW_KINDS] * 8)
    top_p = torch.tensor([kind[1] for kind in ROW_KINDS] * 8)
    min_p = torch.tensor([kind[2] for kind in ROW_KINDS] * 8)
    dense = filter_logits(logits.clone(), top_k, top_p, min_p)
    values, ids = logits.topk(MAX_CANDIDATES, dim=-1)
    log_z = torch.logsumexp(logits, dim=-1)
    kept = filter_logits(values, top_k, top_p, min_p, has_top_k_or_p=True, has_min_p=True, is_sorted=True,
                         log_z=log_z)
    covered = candidates_cover(values, top_k, top_p, min_p, log_z, VOCAB)
    num_covered = 0
    for row in range(64):
        if not covered[row]:
            continue
        num_covered += 1
        expected = set(torch.nonzero(torch.isfinite(dense[row])).flatten().tolist())
        assert set(ids[row][torch.isfinite(kept[row])].tolist()) == expected, f"row {row}"
    # Bounded top-k rows are always covered; unfiltered rows and a top-k past the candidates never are.
    kinds = [ROW_KINDS[row % len(ROW_KINDS)] for row in range(64)]
    assert all(covered[r] for r in range(64) if 0 < kinds[r][0] <= MAX_CANDIDATES)
    assert not any(covered[r] for r in range(64) if kinds[r] in ((100, 0.9, 0.0), (-1, 1.0, 0.0)))
    assert 30 < num_covered < 64


C_SAMPLING = [pytest.param(False, id="torch"),
              pytest.param(True, id="c", marks=pytest.mark.skipif(not cpu_sampling.is_available(),
                                                                 reason="no C compiler: the torch path runs"))]


@pytest.mark.parametrize("is_c_sampling", C_SAMPLING)
def test_candidate_draws_are_the_dense_races_tokens_over_many_positions(is_c_sampling):
    logits = mixed_logits(48, seed=2)
    seqs = kind_seqs(48)
    num_differing_from_greedy = 0
    for _ in range(6):  # six output positions: fresh noise each
        tokens, batch = sample(logits, seqs, is_c_sampling)
        assert batch.num_candidates == MAX_CANDIDATES and not batch.is_candidate_set_exact
        assert tokens == dense_reference(logits, seqs, 0.9)
        num_differing_from_greedy += sum(t != g for t, g in zip(tokens, logits.argmax(-1).tolist()))
        for seq, token in zip(seqs, tokens):
            seq.token_ids.append(token)
    assert num_differing_from_greedy > 48  # real draws, not argmax


def test_bounded_top_k_batches_take_only_their_largest_k():
    seqs = [make_seq(SamplingParams(temperature=0.7, top_k=k, top_p=0.9, seed=1), request_id=f"b{k}")
            for k in (3, 20, 50)]
    logits = mixed_logits(3, seed=4)
    tokens, batch = sample(logits, seqs)
    assert batch.num_candidates == 50 and batch.is_candidate_set_exact and not batch.needs_full_mass
    assert tokens == dense_reference(logits, seqs, 0.7)


@pytest.mark.parametrize("is_c_sampling", C_SAMPLING)
def test_a_rows_token_does_not_depend_on_its_batch_mates_settings(is_c_sampling):
    logits = mixed_logits(16, seed=5)
    seqs = kind_seqs(16)
    together, _ = sample(logits, seqs, is_c_sampling)
    for row in range(16):  # alone, K is only its own need
        alone, _ = sample(logits[row:row + 1], [kind_seqs(16)[row]], is_c_sampling)
        assert alone == [together[row]], f"row {row}"
