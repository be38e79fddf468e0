"""`exact_match` with a regex against lm-evaluation-harness' `regex` filter + `exact_match`, item for item:
lm-eval's `hf` backend answers the 3-shot arithmetic task of lm_eval_tasks.py greedily, its two filter
pipelines (strict-match: the first "#### n", flexible-extract: the last number, group_select -1) score
each response; batchgen's metric with the same regex and options on lm-eval's raw responses must give
the same extracted answer and verdict on every item."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from pydantic import TypeAdapter

from batchgen.metrics import MetricSpec, score_table
from batchgen.metrics.normalize import extract_answer
from tests.metrics.lm_eval_tasks import (
    FLEXIBLE_REGEX,
    GEN_REGEXES_TO_IGNORE,
    GEN_TASK,
    STRICT_REGEX,
    gen_items,
)

pytestmark = pytest.mark.subprocess  # lm-eval's simple_evaluate lists the installed packages in a child

# lm-eval filter name -> batchgen's metric, spelled as in a job file.
METRICS = {
    filter_name: TypeAdapter(MetricSpec).validate_python({
        "type": "exact_match", "reference_column": "answer", "regex": regex, "group_select": group_select,
        "regexes_to_ignore": GEN_REGEXES_TO_IGNORE, "ignore_case": True, "ignore_punctuation": True})
    for filter_name, regex, group_select in (("strict-match", STRICT_REGEX, 0),
                                             ("flexible-extract", FLEXIBLE_REGEX, -1))
}


@pytest.fixture(scope="module")
def reference(lm_eval_results) -> dict[str, list[dict]]:
    """lm-eval's samples per filter, in item order; checked to be the items, answered by one generation."""
    samples = lm_eval_results(GEN_TASK)["samples"][GEN_TASK]
    by_filter = {name: [s for s in samples if s["filter"] == name] for name in METRICS}
    answers = [item["answer"] for item in gen_items()]
    for filtered in by_filter.values():
        assert [s["target"] for s in filtered] == answers
    responses = [[s["resps"][0][0] for s in filtered] for filtered in by_filter.values()]
    assert responses[0] == responses[1]
    # The items discriminate: right and wrong answers, strict-match's fallback, and filters that disagree.
    strict, flexible = ([s["exact_match"] for s in by_filter[name]] for name in METRICS)
    assert 0 < sum(strict) < len(strict) and 0 < sum(flexible) < len(flexible)
    assert any(s["filtered_resps"][0] == "[invalid]" for s in by_filter["strict-match"])
    assert strict != flexible
    return by_filter


@pytest.mark.parametrize("filter_name", METRICS)
def test_exact_match_on_lm_evals_responses_equals_lm_evals_item_for_item(reference, filter_name):
    samples, metric = reference[filter_name], METRICS[filter_name]
    table = pa.table({"completion": [s["resps"][0][0] for s in samples],
                      "answer": [item["answer"] for item in gen_items()]})
    verdicts = score_table("em", metric, table)
    expected = np.array([s["exact_match"] for s in samples], np.float64)
    differing = [int(i) for i in np.flatnonzero(verdicts != expected)]
    print(f"{filter_name}: {len(samples) - len(differing)}/{len(samples)} equal to lm-eval's exact_match")
    assert not differing, f"{filter_name}: differs from lm-eval's on items {differing}"
    # The answer taken out of each response is lm-eval's filtered response.
    extracted = [extract_answer(s["resps"][0][0], metric) for s in samples]
    assert extracted == [s["filtered_resps"][0] for s in samples]
