"""McNemar's exact test (metrics/paired.py) against scipy's exact binomial test, the reference no one here
wrote: on every pair of discordant counts up to 40 each, and on counts large enough that C(n, i) / 2^n
under- or overflows a float."""

from __future__ import annotations

import pytest
from scipy.stats import binomtest

from batchgen.metrics.paired import mcnemar_exact


def scipy_mcnemar(b: int, c: int) -> float:
    """statsmodels' mcnemar(exact=True): the two-sided exact binomial test of min(b, c) in b + c at 1/2."""
    return binomtest(min(b, c), b + c, 0.5).pvalue if b + c else 1.0


def test_equals_scipys_exact_binomial_test_on_a_grid():
    for b in range(41):
        for c in range(41):
            assert mcnemar_exact(b, c) == pytest.approx(scipy_mcnemar(b, c), rel=1e-9, abs=1e-300), (b, c)


@pytest.mark.parametrize("b, c", [(1000, 1300), (5000, 5400), (20000, 20100), (100000, 101000), (3, 4000)])
def test_equals_scipy_for_many_pairs(b, c):
    assert mcnemar_exact(b, c) == pytest.approx(scipy_mcnemar(b, c), rel=1e-8, abs=1e-300)


def test_known_values_and_symmetry():
    assert mcnemar_exact(0, 0) == 1.0 and mcnemar_exact(7, 7) == 1.0
    assert mcnemar_exact(2, 1) == 1.0  # three flips: 2 * (1 + 3) / 8 > 1
    assert mcnemar_exact(0, 5) == pytest.approx(2 / 32, rel=1e-12)
    assert mcnemar_exact(12, 1) == pytest.approx(2 * (1 + 13) / 2 ** 13, rel=1e-12)
    assert mcnemar_exact(3, 17) == mcnemar_exact(17, 3)
    with pytest.raises(ValueError, match="non-negative"):
        mcnemar_exact(-1, 2)
