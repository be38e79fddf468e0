"""The C greedy pick and log-normalizer against their reference (torch's argmax with its first-maximum
rule, logsumexp in float64)."""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels import cpu_sampling
from batchgen.kernels.reference import argmax_log_z_ref


@pytest.mark.parametrize("num_rows,vocab", [(1, 7), (5, 1000), (64, 49152)])  # the last runs on both threads
def test_matches_the_reference_argmax_and_float64_logsumexp(num_rows, vocab):
    torch.manual_seed(0)
    storage = torch.randn(num_rows, vocab + 3) * 6  # rows strided past the vocab
    logits = storage[:, :vocab]
    logits[0, vocab // 2] = logits[0, vocab - 1] = logits[0].max() + 1  # a tie: the first one wins
    if num_rows > 1:
        logits[1, : vocab // 3] = float("-inf")  # banned tokens (min_tokens) stay out
    argmax, log_z = cpu_sampling.argmax_log_z(logits)
    expected_argmax, expected_log_z = argmax_log_z_ref(logits)
    assert torch.equal(argmax, expected_argmax)
    assert torch.equal(cpu_sampling.argmax(logits), argmax)  # the pass without log Z
    assert argmax[0].item() == vocab // 2
    torch.testing.assert_close(log_z, expected_log_z, rtol=1e-6, atol=1e-5)


def test_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="float32"):
        cpu_sampling.argmax_log_z(torch.zeros(2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous rows"):
        cpu_sampling.argmax_log_z(torch.zeros(8, 2).t())


@pytest.mark.parametrize("num_rows,vocab,k", [(1, 7, 7), (5, 1000, 50), (3, 49152, 1024)])
def test_top_k_matches_a_stable_descending_sort_and_the_tempered_log_z(num_rows, vocab, k):
    torch.manual_seed(1)
    storage = torch.randn(num_rows, vocab + 5) * 4
    logits = storage[:, :vocab]
    logits[0, 3] = logits[0, vocab - 1] = logits[0].max() + 1  # a tie at the top: the earlier index first
    if num_rows > 1:
        logits[1, : vocab // 2] = float("-inf")  # banned tokens
        logits[2, 100:110] = logits[2, 90]  # ties inside the list
    inv_t = torch.linspace(0.5, 2.0, num_rows)
    values, ids, log_z = cpu_sampling.top_k_log_z(logits, k, inv_t)
    expected_values, expected_ids = logits.sort(dim=-1, descending=True, stable=True)
    assert torch.equal(values, expected_values[:, :k]) and torch.equal(ids, expected_ids[:, :k])
    assert ids[0, 0].item() == 3
    torch.testing.assert_close(log_z, torch.logsumexp(logits.double() * inv_t[:, None].double(), -1).float(),
                               rtol=1e-6, atol=1e-5)
    assert cpu_sampling.top_k_log_z(logits, k)[2] is None
    with pytest.raises(ValueError, match="k must be"):
        cpu_sampling.top_k_log_z(logits, vocab + 1)
