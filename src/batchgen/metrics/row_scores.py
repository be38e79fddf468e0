"""Per-row verdicts: a metric applied to the rows of an output table (its completion or its
continuations' log-probabilities, and the input columns the metric names). A failed row (null
completion or log-probabilities) scores 0: a request that produced no answer is a wrong answer."""

from __future__ import annotations

import math
import re

import numpy as np
import pyarrow as pa

from batchgen.metrics.normalize import extract_answer, last_number, normalise
from batchgen.metrics.spec import (
    ChoiceAccuracy,
    Contains,
    ExactMatch,
    MetricSpec,
    NumericMatch,
    PassAtK,
    RegexMatch,
)


class MetricError(ValueError):
    """A metric cannot score these rows: a missing or mistyped column, a label out of range. The message
    names the metric and the column."""


def score_table(name: str, spec: MetricSpec, table: pa.Table, *, continuations_column: str | None = None,
                num_workers: int = 2) -> np.ndarray:
    """float64[num_rows]: the metric's verdict per row (1.0 right, 0.0 wrong).

    Generate outputs need `completion`; choice metrics need `continuation_logprob` and, for the label
    as text or for choice_accuracy_norm, the continuations' texts in `continuations_column`.
    """
    for column in spec.input_columns:
        _column(table, column, name)
    if isinstance(spec, ChoiceAccuracy):
        return _choice_verdicts(name, spec, table, continuations_column)
    completions = _column(table, "completion", name).to_pylist()
    if isinstance(spec, PassAtK):
        return _pass_verdicts(name, spec, table, completions, num_workers)
    if isinstance(spec, RegexMatch):
        pattern = re.compile(spec.pattern, re.IGNORECASE if spec.ignore_case else 0)
        return np.array([c is not None and pattern.search(c) is not None for c in completions], np.float64)
    references = [_as_text(v) for v in _column(table, spec.reference_column, name).to_pylist()]
    if isinstance(spec, NumericMatch):
        return np.array([_numbers_match(c, r, spec) for c, r in zip(completions, references)], np.float64)
    verdicts = np.zeros(len(completions), np.float64)
    for i, (completion, reference) in enumerate(zip(completions, references)):
        if completion is None or reference is None:
            continue
        answer = normalise(extract_answer(completion, spec), spec)
        expected = normalise(reference, spec)
        if isinstance(spec, ExactMatch):
            verdicts[i] = answer == expected
        elif isinstance(spec, Contains):
            verdicts[i] = expected in answer
    return verdicts


def _column(table: pa.Table, column: str, metric: str) -> pa.ChunkedArray:
    if column not in table.column_names:
        raise MetricError(f"metric {metric}: the output has no column {column!r}; columns are: "
                          f"{', '.join(table.column_names)}")
    return table.column(column)


def _as_text(value: object) -> str | None:
    """A reference cell as text: strings as they are, numbers as written (3.0 -> "3")."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _numbers_match(completion: str | None, reference: str | None, spec: NumericMatch) -> bool:
    got, expected = last_number(completion), last_number(reference)
    if got is None or expected is None:
        return False
    return math.isclose(got, expected, rel_tol=spec.rel_tol, abs_tol=spec.abs_tol)


def _choice_verdicts(name: str, spec: ChoiceAccuracy, table: pa.Table,
                     continuations_column: str | None) -> np.ndarray:
    logprobs = _column(table, "continuation_logprob", name).to_pylist()
    labels = _column(table, spec.label_column, name).to_pylist()
    needs_texts = spec.is_normalised or any(isinstance(label, str) for label in labels)
    texts: list | None = None
    if needs_texts:
        if continuations_column is None:
            raise MetricError(f"metric {name}: needs the continuations' texts (input.continuations_column)")
        texts = _column(table, continuations_column, name).to_pylist()
    verdicts = np.zeros(len(logprobs), np.float64)
    for i, (row_logprobs, label) in enumerate(zip(logprobs, labels)):
        if row_logprobs is None or label is None:
            continue
        continuations = None if texts is None else texts[i]
        choices = None if texts is None else [_choice_text(c, spec.target_delimiter) for c in continuations]
        gold = _label_index(name, spec, label, choices, continuations, len(row_logprobs))
        scores = np.asarray(row_logprobs, np.float64)
        if spec.is_normalised:
            lengths = [len(c.encode("utf-8")) if spec.length_unit == "bytes" else len(c) for c in choices]
            scores = scores / np.asarray(lengths, np.float64)
        verdicts[i] = int(np.argmax(scores)) == gold
    return verdicts


def _choice_text(continuation: str, target_delimiter: str) -> str:
    """The choice a continuation scores, as lm-eval's multiple_choice holds it (its length is acc_norm's
    divisor, a text label names it): the continuation without its leading target delimiter."""
    if target_delimiter and continuation.startswith(target_delimiter):
        return continuation[len(target_delimiter):]
    return continuation


def _label_index(name: str, spec: ChoiceAccuracy, label: object, choices: list | None,
                 continuations: list | None, num_choices: int) -> int:
    """The label's continuation: an index, or a text naming a choice (as lm-eval looks it up) or, failing
    that, a continuation as written."""
    if isinstance(label, str):
        for texts in (choices, continuations):
            if label in texts:
                return texts.index(label)
        raise MetricError(f"metric {name}: {spec.label_column} {label!r} is none of the row's continuations "
                          f"{continuations!r} (nor one without its target_delimiter "
                          f"{spec.target_delimiter!r})")
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < num_choices:
        raise MetricError(f"metric {name}: {spec.label_column} {label!r} is not the index of one of the "
                          f"row's {num_choices} continuations")
    return label


def _pass_verdicts(name: str, spec: PassAtK, table: pa.Table, completions: list, num_workers: int) -> np.ndarray:
    from batchgen.metrics.code_exec import CodeLimits, humaneval_program, run_programs

    tests = _column(table, spec.test_column, name).to_pylist()
    entry_points = (_column(table, spec.entry_point_column, name).to_pylist() if spec.entry_point_column
                    else [None] * len(completions))
    prompts = (_column(table, spec.prompt_column, name).to_pylist() if spec.prompt_column
               else [""] * len(completions))
    runnable = [i for i, c in enumerate(completions) if c is not None and tests[i] is not None]
    programs = [humaneval_program(prompts[i] or "", completions[i], tests[i], entry_points[i]) for i in runnable]
    limits = CodeLimits(timeout_s=spec.timeout_s, memory_bytes=spec.memory_mb << 20)
    verdicts = np.zeros(len(completions), np.float64)
    for i, verdict in zip(runnable, run_programs(programs, limits, max_workers=num_workers)):
        verdicts[i] = verdict.is_passed
    return verdicts
