"""Two runs' verdicts on the same rows: is the change beyond noise?

McNemar's exact test (the paired test for two classifiers on one test set): only the discordant rows
count, b that went right -> wrong and c that went wrong -> right; under "no change" each discordant row
is a fair coin, so min(b, c) is Binomial(b + c, 1/2) and the two-sided p-value is

    p = min(1, 2 * sum_{i <= min(b, c)} C(b + c, i) / 2^(b + c))

(statsmodels' `mcnemar(..., exact=True)`, scipy's `binomtest(min(b, c), b + c, 0.5)`).
"""

from __future__ import annotations

import math

_NEGLIGIBLE = 1e-18  # a term this small next to the sum changes no digit of a float64 p-value


def mcnemar_exact(num_right_to_wrong: int, num_wrong_to_right: int) -> float:
    """The two-sided exact McNemar p-value of b = num_right_to_wrong and c = num_wrong_to_right discordant
    pairs (1.0 when there are none, or b == c)."""
    b, c = int(num_right_to_wrong), int(num_wrong_to_right)
    if b < 0 or c < 0:
        raise ValueError(f"discordant pair counts must be non-negative, got {b} and {c}")
    n, low = b + c, min(b, c)
    if 2 * low >= n:
        return 1.0
    # The binomial terms rise with i up to n / 2, so the tail's largest term is its last, i = low; it is
    # taken in log space (C(n, i) / 2^n under- or overflows a float for large n) and the smaller terms
    # follow from term(i - 1) = term(i) * i / (n - i + 1) until they stop mattering.
    term = math.exp(math.lgamma(n + 1) - math.lgamma(low + 1) - math.lgamma(n - low + 1) - n * math.log(2))
    tail = 0.0
    for i in range(low, -1, -1):
        tail += term
        if term < _NEGLIGIBLE * tail:
            break
        term *= i / (n - i + 1)
    return min(1.0, 2.0 * tail)
