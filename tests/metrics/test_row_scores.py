"""Per-row verdicts on hand-made tables: numbers as GSM8K scorers read them, labels as index or text,
failed rows, and bad input named by metric and column."""

from __future__ import annotations

import pyarrow as pa
import pytest
from pydantic import TypeAdapter

from batchgen.metrics import MetricError, MetricSpec, score_table
from batchgen.metrics.normalize import last_number

spec = TypeAdapter(MetricSpec).validate_python


@pytest.mark.parametrize("text, number", [
    ("The answer is 42.", 42.0), ("#### 1,234", 1234.0), ("costs $5.50 or -3", -3.0), ("no digits", None),
    ("x = .5", 0.5), ("12 apples and 7 pears: 19", 19.0), (None, None)])
def test_last_number(text, number):
    assert last_number(text) == number


def test_numeric_match_takes_the_last_number_on_each_side():
    table = pa.table({"completion": ["so it is 1,000", "about 3.14159", "seven", None, "42"],
                      "gold": ["#### 1000", "3.1416", "7", "5", "41.9999999"]})
    verdicts = score_table("num", spec({"type": "numeric_match", "reference_column": "gold", "abs_tol": 1e-4}), table)
    assert verdicts.tolist() == [1.0, 1.0, 0.0, 0.0, 1.0]


def test_numeric_references_compare_as_written():
    table = pa.table({"completion": ["3", "3.0", "2"], "gold": pa.array([3.0, 3.0, 3.0])})
    assert score_table("em", spec({"type": "exact_match", "reference_column": "gold"}), table).tolist() == [1, 0, 0]


def test_contains_and_exact_match_normalise_both_sides():
    table = pa.table({"completion": ["The capital of Germany is Berlin.", "berlin!", None],
                      "gold": ["Berlin", "BERLIN", "Berlin"]})
    contains = spec({"type": "contains", "reference_column": "gold"})
    exact = spec({"type": "exact_match", "reference_column": "gold", "ignore_case": True,
                  "ignore_punctuation": True})
    assert score_table("c", contains, table).tolist() == [1.0, 0.0, 0.0]
    assert score_table("e", exact, table).tolist() == [0.0, 1.0, 0.0]


def test_choice_labels_by_index_or_text_and_failed_rows():
    table = pa.table({"continuation_logprob": [[-1.0, -2.0], [-3.0, -2.5], None],
                      "choices": [[" a", " bb"], [" a", " bb"], [" a", " bb"]],
                      "label": [0, 0, 1], "label_text": [" a", " bb", " a"]})
    acc = score_table("acc", spec({"type": "choice_accuracy", "label_column": "label"}), table,
                      continuations_column="choices")
    by_text = score_table("acc", spec({"type": "choice_accuracy", "label_column": "label_text"}), table,
                          continuations_column="choices")
    # per character: -1/2 vs -2/3 -> " a"; -3/2 vs -2.5/3 -> " bb"
    norm = score_table("n", spec({"type": "choice_accuracy_norm", "label_column": "label"}), table,
                       continuations_column="choices")
    assert acc.tolist() == [1.0, 0.0, 0.0] and by_text.tolist() == [1.0, 1.0, 0.0] and norm.tolist() == [1.0, 0.0, 0.0]


@pytest.mark.parametrize("labels, words", [([5], "not the index of one of the row's 2"),
                                           (["zzz"], "is none of the row's continuations")])
def test_a_bad_label_names_the_metric_and_column(labels, words):
    table = pa.table({"continuation_logprob": [[-1.0, -2.0]], "choices": [[" a", " b"]], "label": labels})
    with pytest.raises(MetricError, match=f"metric acc: label .*{words}"):
        score_table("acc", spec({"type": "choice_accuracy", "label_column": "label"}), table,
                    continuations_column="choices")


def test_a_missing_column_names_the_metric():
    with pytest.raises(MetricError, match="metric em: the output has no column 'gold'"):
        score_table("em", spec({"type": "exact_match", "reference_column": "gold"}), pa.table({"completion": ["x"]}))
