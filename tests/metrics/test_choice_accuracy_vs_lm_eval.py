"""`choice_accuracy` / `choice_accuracy_norm` against lm-evaluation-harness' `acc` / `acc_norm` from its
own `hf` backend, item for item, on the 40 multiple-choice items of lm_eval_tasks.py:

- on lm-eval's own per-choice log-likelihoods: the definitions agree exactly;
- on batchgen's engine's log-likelihoods of the same contexts and continuations, laid out as lm-eval
  sends them (the continuation " Paris" after the context), through `LLM.score_continuations` and through
  a `task: loglikelihood` job with `metrics:` (its verdict columns, and its _SUCCESS aggregates against
  lm-eval's acc and acc_stderr): the verdicts agree, a flip only where a near-tie's log-likelihoods
  differ by < 1e-4.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from pydantic import TypeAdapter

from batchgen.metrics import MetricSpec, score_table
from tests.metrics.lm_eval_tasks import MC_PROMPT, MC_TASK, mc_items

pytestmark = pytest.mark.subprocess  # lm-eval's simple_evaluate lists the installed packages in a child

SPECS = {lm_eval_name: TypeAdapter(MetricSpec).validate_python({"type": kind, "label_column": "label"})
         for lm_eval_name, kind in (("acc", "choice_accuracy"), ("acc_norm", "choice_accuracy_norm"))}
LOGLIK_TOLERANCE = 1e-4


def verdicts_of(spec, items: list[dict], logprobs: list[list[float]],
                continuations: list[list[str]]) -> np.ndarray:
    """score_table's verdicts in item order. A column holds one type, so the items labelled by index and
    those labelled by text go in a table each."""
    verdicts = np.full(len(items), np.nan)
    for is_text_label in (False, True):
        rows = [i for i, item in enumerate(items) if isinstance(item["label"], str) == is_text_label]
        table = pa.table({
            "continuation_logprob": pa.array([logprobs[i] for i in rows], pa.list_(pa.float64())),
            "label": [items[i]["label"] for i in rows],
            "choices": pa.array([continuations[i] for i in rows], pa.list_(pa.string())),
        })
        verdicts[rows] = score_table("m", spec, table, continuations_column="choices")
    return verdicts


@pytest.fixture(scope="module")
def reference(lm_eval_results):
    """lm-eval's samples of the multiple-choice task, checked to be the items this module scores."""
    samples = lm_eval_results(MC_TASK)["samples"][MC_TASK]
    items = mc_items()
    assert [s["doc"]["choices"] for s in samples] == [item["choices"] for item in items]
    assert sum(isinstance(item["label"], str) for item in items) >= 5  # the text-label path is exercised
    # The items discriminate: some are wrong, and acc and acc_norm pick differently on some.
    for name in SPECS:
        assert 0 < sum(s[name] for s in samples) < len(samples), name
    assert sum(s["acc"] != s["acc_norm"] for s in samples) >= 5
    return samples


def lm_eval_logliks(samples: list[dict]) -> list[list[float]]:
    return [[float(ll) for ll, _ in s["filtered_resps"]] for s in samples]


@pytest.mark.parametrize("name", SPECS)
def test_on_lm_evals_logliks_the_verdicts_equal_lm_evals_item_for_item(reference, name):
    items = mc_items()
    choices = [item["choices"] for item in items]
    verdicts = verdicts_of(SPECS[name], items, lm_eval_logliks(reference), choices)
    expected = np.array([s[name] for s in reference])
    differing = [int(i) for i in np.flatnonzero(verdicts != expected)]
    print(f"{name}: {len(items) - len(differing)}/{len(items)} equal to lm-eval's")
    assert not differing, f"{name} differs from lm-eval's on items {differing}"


def contexts_and_continuations() -> tuple[list[str], list[list[str]]]:
    """The items as lm-eval's requests are: the context, then each choice after lm-eval's target_delimiter
    (" Paris"): what a batchgen job scores is written that way."""
    items = mc_items()
    return ([MC_PROMPT.format(question=item["question"]) for item in items],
            [[" " + choice for choice in item["choices"]] for item in items])


def check_flips(label: str, verdicts, expected, ours, theirs) -> list[int]:
    """Verdicts from our log-likelihoods against lm-eval's verdicts: equal, but where a near-tie flips,
    the two log-likelihoods of that item agree within LOGLIK_TOLERANCE. The flipped items."""
    gaps = np.abs(np.asarray(ours) - np.asarray(theirs)).max(axis=1)
    flipped = [int(i) for i in np.flatnonzero(np.asarray(verdicts) != np.asarray(expected))]
    print(f"{label}: {len(expected) - len(flipped)}/{len(expected)} equal to lm-eval's, max |d loglik| = "
          f"{gaps.max():.2e}, {len(flipped)} disagreements")
    for i in flipped:
        assert gaps[i] < LOGLIK_TOLERANCE, f"{label}: item {i} flipped with |d loglik| = {gaps[i]:.2e}"
    assert gaps.max() < 1e-3  # the same log-likelihoods throughout (a looser bound over every item)
    return flipped


@pytest.fixture(scope="module")
def engine_logliks(reference, llm) -> list[list[float]]:
    """LLM.score_continuations on exactly the requests lm-eval's hf backend ran."""
    contexts, continuations = contexts_and_continuations()
    assert [[tuple(a) for a in s["arguments"]] for s in reference] == [
        [(context, c) for c in conts] for context, conts in zip(contexts, continuations)]
    outputs = llm.score_continuations(contexts, continuations)
    return [[c.sum_logprob for c in out.continuations] for out in outputs]


@pytest.mark.parametrize("name", SPECS)
def test_on_the_engines_logliks_the_verdicts_equal_lm_evals_item_for_item(reference, engine_logliks, name):
    ours, (_, continuations) = engine_logliks, contexts_and_continuations()
    # The continuations are what was scored, delimiter included: the metric measures the choice.
    verdicts = verdicts_of(SPECS[name], mc_items(), ours, continuations)
    check_flips(f"{name} (LLM.score_continuations)", verdicts, [s[name] for s in reference], ours,
                lm_eval_logliks(reference))


@pytest.fixture(scope="module")
def job_run(tmp_path_factory, llm):
    """A `task: loglikelihood` job over the items with `metrics:` choice_accuracy and
    choice_accuracy_norm, each against the label as an index (`gold`) and as text (`answer`):
    (its output table, its _SUCCESS record)."""
    from batchgen.pipeline.config import validate_job
    from batchgen.pipeline.job import run_job
    from tests.conftest import TEST_ENGINE_KWARGS
    from tests.pipeline.conftest import engine_sections, read_output, write_parquet

    tmp = tmp_path_factory.mktemp("mc_job")
    items = mc_items()
    contexts, continuations = contexts_and_continuations()
    path = write_parquet(tmp / "items.parquet", {
        "id": list(range(len(items))), "prompt": contexts, "choices": continuations,
        "gold": [item["gold"] for item in items],
        "answer": [item["choices"][item["gold"]] for item in items]})
    metrics = {f"{name}{suffix}": {"type": spec.type, "label_column": column}
               for name, spec in SPECS.items() for suffix, column in (("", "gold"), ("_text", "answer"))}
    job = validate_job({
        "name": "mc-against-lm-eval", "task": "loglikelihood", **engine_sections(TEST_ENGINE_KWARGS),
        "input": {"path": str(path), "prompt_column": "prompt", "continuations_column": "choices",
                  "apply_chat_template": False},
        "output": {"path": str(tmp / "out")}, "metrics": metrics}, tmp)
    result = run_job(job, engine=llm.engine, progress=False)
    return read_output(tmp / "out"), result.record


@pytest.mark.parametrize("name", SPECS)
def test_a_loglikelihood_jobs_metrics_equal_lm_evals_item_for_item(reference, lm_eval_results, job_run, name):
    out, record = job_run
    assert out.column("id").to_pylist() == list(range(len(reference)))
    ours, theirs = out.column("continuation_logprob").to_pylist(), lm_eval_logliks(reference)
    expected = [s[name] for s in reference]
    aggregates = lm_eval_results(MC_TASK)["results"][MC_TASK]
    for metric in (name, f"{name}_text"):
        verdicts = out.column(f"metric_{metric}").to_pylist()
        flipped = check_flips(f"{metric} (job)", verdicts, expected, ours, theirs)
        score = record.metrics[metric]
        assert (score.value, score.n) == (pytest.approx(np.mean(verdicts)), len(verdicts))
        if not flipped:  # the same verdicts: lm-eval's aggregate and its standard error
            assert score.value == pytest.approx(aggregates[f"{name},none"])
            assert score.stderr == pytest.approx(aggregates[f"{name}_stderr,none"])
