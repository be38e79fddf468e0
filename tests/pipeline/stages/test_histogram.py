"""A select stage's histograms: one bin per integer for a judge's small integer scale, numpy's equal-width
bins otherwise, and the one-line text `batchgen run` prints."""

from __future__ import annotations

import numpy as np

from batchgen.pipeline.stages.histogram import format_histogram, histogram


def test_integer_scores_get_a_bin_per_value():
    hist = histogram([1, 5, 5, 3, float("nan")])  # a NaN (a failed sample) is left out
    assert hist == {"edges": [0.5, 1.5, 2.5, 3.5, 4.5, 5.5], "counts": [1, 0, 1, 0, 2]}
    assert format_histogram(hist) == "1: 1, 3: 1, 5: 2"


def test_other_scores_get_numpys_equal_width_bins():
    values = np.random.default_rng(0).normal(size=200)
    counts, edges = np.histogram(values, bins=10)
    hist = histogram(values)
    assert hist == {"edges": list(edges), "counts": list(counts)} and sum(hist["counts"]) == 200
    assert format_histogram(hist).endswith(f"{edges[-1]:.4g}]: {counts[-1]}")  # the last bin is closed


def test_one_value_and_no_value():
    assert histogram([0.25, 0.25]) == {"edges": [-0.25, 0.75], "counts": [2]}
    assert histogram([]) is None and histogram([float("nan")]) is None
