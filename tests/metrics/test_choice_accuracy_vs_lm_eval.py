"""`choice_accuracy` / `choice_accuracy_norm` against lm-evaluation-harness' `acc` / `acc_norm` from its
own `hf` backend, item for item, on the 40 multiple-choice items of lm_eval_tasks.py:

- on lm-eval's own per-choice log-likelihoods: the definitions agree exactly;
- on batchgen's engine's log-likelihoods of the same contexts and continuations (`LLM.score_continuations`,
  what a `task: loglikelihood` job runs), laid out as lm-eval sends them (the continuation " Paris" after
  the context): the verdicts agree, a flip only where a near-tie's log-likelihoods differ by < 1e-4.
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
def reference(lm_eval_samples):
    """lm-eval's samples of the multiple-choice task, checked to be the items this module scores."""
    samples = lm_eval_samples(MC_TASK)
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


@pytest.fixture(scope="module")
def engine_logliks(llm, reference) -> list[list[float]]:
    """batchgen's engine's log-likelihood of each choice, the continuation written with lm-eval's
    target_delimiter (" Paris") after the context, exactly the requests lm-eval's hf backend ran."""
    items = mc_items()
    contexts = [MC_PROMPT.format(question=item["question"]) for item in items]
    continuations = [[" " + choice for choice in item["choices"]] for item in items]
    assert [[tuple(a) for a in s["arguments"]] for s in reference] == [
        [(context, c) for c in conts] for context, conts in zip(contexts, continuations)]
    outputs = llm.score_continuations(contexts, continuations)
    return [[c.sum_logprob for c in out.continuations] for out in outputs]


@pytest.mark.parametrize("name", SPECS)
def test_on_the_engines_logliks_the_verdicts_equal_lm_evals_item_for_item(reference, engine_logliks, name):
    items = mc_items()
    theirs = np.array(lm_eval_logliks(reference))
    ours = np.array(engine_logliks)
    gaps = np.abs(ours - theirs).max(axis=1)
    # The job's continuations are what was scored, delimiter included: the metric measures the choice.
    continuations = [[" " + choice for choice in item["choices"]] for item in items]
    verdicts = verdicts_of(SPECS[name], items, engine_logliks, continuations)
    expected = np.array([s[name] for s in reference])
    flipped = [int(i) for i in np.flatnonzero(verdicts != expected)]
    print(f"{name}: {len(items) - len(flipped)}/{len(items)} equal to lm-eval's, max |d loglik| = "
          f"{gaps.max():.2e}, {len(flipped)} disagreements")
    for i in flipped:  # only a near-tie may flip: the log-likelihoods agree within the tolerance
        assert gaps[i] < LOGLIK_TOLERANCE, f"item {i} flipped with |d loglik| = {gaps[i]:.2e}"
    assert gaps.max() < 1e-3  # the engine computes the same log-likelihoods (a looser bound over all)
