"""A choice metric measures and names the choice as lm-eval does: lm-eval scores `target_delimiter +
choice` (" Paris") but divides by len(choice) for acc_norm and looks a text label up among the choices.
A job's continuations are what is scored, so the delimiter is part of them; the metric takes it off."""

from __future__ import annotations

import pyarrow as pa
import pytest
from pydantic import TypeAdapter

from batchgen.metrics import MetricError, MetricSpec, score_table

# Per character, without the space: -2.1/2 = -1.05 < -4.0/4 = -1.0 (picks 1); counting the space:
# -2.1/3 = -0.70 > -4.0/5 = -0.80 (would pick 0). Raw log-likelihood picks 0.
LOGPROBS = [-2.1, -4.0]


def verdict(spec: dict, continuations: list[str], label) -> float:
    table = pa.table({"continuation_logprob": [LOGPROBS], "label": [label], "choices": [continuations]})
    metric = TypeAdapter(MetricSpec).validate_python({"label_column": "label", **spec})
    return float(score_table("m", metric, table, continuations_column="choices")[0])


@pytest.mark.parametrize("continuations", [[" ab", " abcd"], ["ab", "abcd"]])
def test_acc_norm_divides_by_the_choices_length_without_the_delimiter(continuations):
    assert verdict({"type": "choice_accuracy_norm"}, continuations, 1) == 1.0
    assert verdict({"type": "choice_accuracy"}, continuations, 0) == 1.0


def test_an_empty_target_delimiter_counts_the_leading_space():
    # lm-eval tasks with target_delimiter: "" whose choices carry the space (inverse_scaling's " Yes").
    assert verdict({"type": "choice_accuracy_norm", "target_delimiter": ""}, [" ab", " abcd"], 0) == 1.0


@pytest.mark.parametrize("label, expected_index", [("ab", 0), ("abcd", 1), (" abcd", 1)])
def test_a_text_label_names_a_choice_or_a_continuation_as_written(label, expected_index):
    right = verdict({"type": "choice_accuracy"}, [" ab", " abcd"], label)
    assert right == (1.0 if expected_index == 0 else 0.0)  # raw log-likelihood picks choice 0


def test_a_text_label_that_names_no_choice_is_an_error_naming_the_column():
    with pytest.raises(MetricError, match="label 'Rome' is none of the row's continuations"):
        verdict({"type": "choice_accuracy"}, [" ab", " abcd"], "Rome")
