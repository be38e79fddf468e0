"""The keyed generator: draws are a pure function of (sequence key, position, token), and the
sampler's keyed draws still follow the processed distribution (a chi-square test a biased sampler fails).
"""

from __future__ import annotations

import torch

from batchgen.engine.sampling import sampler as sampler_module
from batchgen.engine.sampling.keyed_random import (
    keyed_exponential,
    keyed_exponential_at,
    keyed_uniform,
    sequence_key,
)
from batchgen.engine.sampling.sampler import Sampler, race
from batchgen.engine.sampling.sampling_params import SamplingParams
from tests.engine.sampling.test_sampler import (
    EOS,
    VOCAB,
    allowed_tokens,
    draws_at_successive_positions,
    make_seq,
)

NUM_SAMPLES, NUM_POSITIONS = 200, 100  # 20,000 draws
TEMPERATURE, TOP_P = 0.8, 0.9


def chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson's test of `counts` against `expected_probs` over the cells the latter gives mass to."""
    cells = expected_probs > 0
    n = counts.sum().double()
    expected = n * expected_probs[cells].double()
    statistic = ((counts[cells].double() - expected) ** 2 / expected).sum()
    df = torch.tensor(float(cells.sum() - 1), dtype=torch.float64)
    return torch.special.gammaincc(df / 2, statistic / 2).item()  # the chi-square survival function


def processed_distribution(row: torch.Tensor) -> torch.Tensor:
    """Temperature then top-p, from the definition (float64), over the whole vocabulary."""
    probs = (row.double() / TEMPERATURE).softmax(-1)
    keep = torch.zeros(VOCAB, dtype=torch.bool)
    keep[list(allowed_tokens(row / TEMPERATURE, -1, TOP_P, 0.0))] = True
    probs = torch.where(keep, probs, torch.zeros_like(probs))
    return probs / probs.sum()


def sampled_counts() -> torch.Tensor:
    row = torch.randn(VOCAB, generator=torch.Generator().manual_seed(21)) * 2
    logits = row.expand(NUM_SAMPLES, VOCAB).clone()
    seqs = [make_seq(SamplingParams(temperature=TEMPERATURE, top_p=TOP_P, seed=4), request_id=f"r{i}")
            for i in range(NUM_SAMPLES)]
    draws = draws_at_successive_positions(Sampler(eos_token_ids=(EOS,)), logits, seqs, NUM_POSITIONS)
    return torch.bincount(torch.tensor(draws).flatten(), minlength=VOCAB), processed_distribution(row)


def test_keyed_draws_pass_a_chi_square_test_of_the_processed_distribution():
    counts, expected = sampled_counts()
    assert counts.sum() == NUM_SAMPLES * NUM_POSITIONS
    assert counts[expected == 0].sum() == 0  # nothing outside the nucleus, ever
    assert (expected > 0).sum() > 5  # a real choice at every draw
    assert chi_square_p_value(counts, expected) >= 0.001


def test_a_sampler_that_ignores_top_p_fails_the_same_test(monkeypatch):
    real_filter = sampler_module.filter_logits
    monkeypatch.setattr(sampler_module, "filter_logits",
                        lambda logits, top_k, top_p, min_p, **flags: real_filter(logits, top_k, torch.ones_like(top_p),
                                                                                  min_p, **flags))
    counts, expected = sampled_counts()
    assert chi_square_p_value(counts, expected) < 0.001


def test_a_sampler_whose_noise_ignores_the_position_fails_it(monkeypatch):
    real_race = sampler_module.race
    monkeypatch.setattr(sampler_module, "race", lambda probs, keys, positions: real_race(probs, keys, positions * 0))
    counts, expected = sampled_counts()
    assert chi_square_p_value(counts, expected) < 0.001  # 200 draws repeated 100 times


def test_uniforms_are_uniform_and_each_key_position_has_its_own():
    keys = torch.tensor([sequence_key(0, "a", 0), sequence_key(0, "a", 1), sequence_key(1, "a", 0)] * 2)
    positions = torch.tensor([0, 0, 0, 1, 1, 1])
    u = keyed_uniform(keys, positions, 50_000)  # (6, V)
    assert u.dtype == torch.float32 and bool((u > 0).all()) and bool((u < 1).all())
    assert abs(u.mean().item() - 0.5) < 0.003 and abs(u.var().item() - 1 / 12) < 0.002
    for i in range(6):
        for j in range(i):
            assert abs(torch.corrcoef(torch.stack([u[i], u[j]]))[0, 1].item()) < 0.03
    assert torch.equal(keyed_uniform(keys, positions, 50_000), u)  # a pure function
    assert torch.equal(keyed_uniform(keys[3:4], positions[3:4], 50_000), u[3:4])  # of its own row only


def test_the_largest_draw_is_below_one_so_no_exponential_is_zero():
    """(2^24 - 1 + 0.5) / 2^24 rounds to 1.0 in float32: an exponential of 0, which would win the race
    at any probability, and 0 / 0 = NaN (taken by argmax) at a token a filter or a grammar removed."""
    from batchgen.engine.sampling.keyed_random import uniform_of_bits

    bits = torch.tensor([0, 1, 2**23, 2**24 - 2, 2**24 - 1], dtype=torch.int32)
    u = uniform_of_bits(bits)
    assert bool((u > 0).all()) and bool((u < 1).all())
    assert bool((-torch.log(u) > 0).all())
    assert torch.equal(u[:4], (bits[:4].double() + 0.5).div(2**24).float())  # the others are exact


def test_draws_at_chosen_entries_equal_the_dense_draws():
    keys = torch.tensor([sequence_key(7, "x", i) for i in range(4)])
    positions = torch.tensor([0, 3, 9, 2**20])
    dense = keyed_exponential(keys, positions, 1000)  # (4, V)
    rows = torch.tensor([0, 0, 1, 2, 3, 3])
    cols = torch.tensor([0, 999, 5, 500, 1, 2])
    assert torch.equal(keyed_exponential_at(keys[rows], positions[rows], cols), dense[rows, cols])


def test_race_gives_the_same_token_with_a_small_support_or_a_full_one():
    gen = torch.Generator().manual_seed(2)
    probs = torch.rand(64, 300, generator=gen)
    sparse = probs.clone()
    sparse[:, 20:] = 0  # small support: the noise is computed at its entries only
    keys = torch.arange(64, dtype=torch.int64) * 977
    positions = torch.arange(64, dtype=torch.int64)
    from_sparse = race(sparse, keys, positions)
    dense_noise = keyed_exponential(keys, positions, 300)
    assert torch.equal(from_sparse, (sparse / dense_noise).argmax(-1))
    assert bool((from_sparse < 20).all())
    assert torch.equal(race(probs, keys, positions), (probs / dense_noise).argmax(-1))


def test_a_sample_draws_the_same_alone_and_among_other_rows():
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(33, VOCAB, generator=gen) * 2
    params = [SamplingParams(temperature=0.5 + 0.05 * i, top_p=0.95, seed=i % 3, n=2) for i in range(32)]
    seqs = [make_seq(p, request_id=f"q{i}", sample_index=i % 2) for i, p in enumerate(params)]
    seqs.insert(0, make_seq(SamplingParams(temperature=0)))  # a greedy row among them
    together = draws_at_successive_positions(Sampler(eos_token_ids=(EOS,)), logits, seqs, 6)
    for i in (1, 7, 32):
        seq = make_seq(params[i - 1], request_id=f"q{i - 1}", sample_index=(i - 1) % 2)
        alone = draws_at_successive_positions(Sampler(eos_token_ids=(EOS,)), logits[i:i + 1], [seq], 6)
        assert [row[0] for row in alone] == [row[i] for row in together]
