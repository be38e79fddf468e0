"""task: select over an earlier stage's rows with a reward column: DPO pairs in TRL's formats, best of n, filter.

The input is synthetic (n = 4 samples per prompt, rewards on a coarse grid so that ties happen, some null);
every expectation is recomputed here from the input rows, and the output is checked with TRL's own
format check and loaded as a datasets.Dataset.
"""

from __future__ import annotations

import random
from collections import defaultdict

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from batchgen.pipeline.errors import JobError
from batchgen.pipeline.stages import load_any_job
from batchgen.pipeline.stages.run import run_staged_job
from tests.pipeline.conftest import write_parquet

NUM_PROMPTS, N = 60, 4


def _samples(tmp_path, *, as_messages: bool = True):
    rng = random.Random(7)
    rows = defaultdict(list)
    for prompt in range(NUM_PROMPTS):
        tie = prompt % 10 == 0  # every sample of these prompts scores the same
        for sample in range(N):
            reward = 0.5 if tie else rng.choice([-1.0, -0.5, 0.0, 0.25, 0.5, 1.0, 2.0])
            if prompt % 17 == 3 and sample == 1:
                reward = None  # a failed sample: no score
            rows["id"].append(f"p{prompt}")
            rows["sample_index"].append(sample)
            text = f"question {prompt}"
            rows["messages" if as_messages else "prompt"].append(
                [{"role": "user", "content": text}] if as_messages else text)
            rows["completion"].append(f"answer {prompt}.{sample}")
            rows["reward"].append(reward)
            rows["finish_reason"].append("stop" if sample != 3 else "length")
    return write_parquet(tmp_path / "scored" / "part-00000.parquet", dict(rows)), rows


def _job(tmp_path, input_path, select: dict) -> str:
    job = {"name": "sel", "output": {"path": str(tmp_path / "out")},
           "stages": [{"name": "pick", "task": "select", "input": {"path": str(input_path)}, "select": select}]}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return str(path)


def _run(tmp_path, input_path, select: dict):
    staged = load_any_job(_job(tmp_path, input_path, select))
    [result] = run_staged_job(staged, progress=False)
    return pq.read_table(tmp_path / "out" / "pick" / "part-00000.parquet"), result.record


def _by_prompt(rows) -> dict[str, list[tuple[float, str]]]:
    scored = defaultdict(list)
    for i, reward in enumerate(rows["reward"]):
        if reward is not None:
            scored[rows["id"][i]].append((reward, rows["completion"][i]))
    return scored


@pytest.mark.parametrize("min_margin", [0.0, 1.0])
def test_dpo_pairs_choose_the_max_reject_the_min_and_count_every_drop(tmp_path, min_margin):
    from datasets import Dataset
    from trl.data_utils import is_conversational

    path, rows = _samples(tmp_path)
    table, record = _run(tmp_path, path, {"rule": "dpo_pairs", "min_margin": min_margin,
                                          "keep_columns": ["finish_reason"]})
    scored = _by_prompt(rows)
    expected = {i: s for i, s in scored.items() if max(s)[0] - min(s)[0] > 0 and max(s)[0] - min(s)[0] >= min_margin}
    ties = [i for i, s in scored.items() if max(s)[0] == min(s)[0]]
    below = [i for i, s in scored.items() if 0 < max(s)[0] - min(s)[0] < min_margin]
    assert ties and (below or min_margin == 0)
    pairs = table.to_pylist()
    assert [p["id"] for p in pairs] == list(expected)  # input order of the prompts
    for pair in pairs:
        samples = expected[pair["id"]]
        assert pair["chosen_score"] == max(r for r, _ in samples)
        assert pair["rejected_score"] == min(r for r, _ in samples)
        assert pair["chosen_score"] - pair["rejected_score"] >= min_margin
        assert (pair["chosen_score"], pair["chosen"][0]["content"]) in samples
        assert (pair["rejected_score"], pair["rejected"][0]["content"]) in samples
        assert pair["prompt"] == [{"role": "user", "content": f"question {pair['id'][1:]}"}]
        assert pair["chosen"][0]["role"] == "assistant"
        assert is_conversational(pair)
    counts = record.select
    assert counts["num_ties"] == len(ties)
    assert counts["num_below_margin"] == len(below)
    assert counts["num_unscored_rows"] == sum(r is None for r in rows["reward"])
    assert counts["num_output_rows"] == len(pairs) == NUM_PROMPTS - len(ties) - len(below)
    # the scores' histogram: every scored row (not integers: numpy's 10 equal-width bins)
    every_score = [r for r in rows["reward"] if r is not None]
    want_counts, want_edges = np.histogram(every_score, bins=10)
    assert counts["score_histogram"] == {"edges": list(want_edges), "counts": list(want_counts)}
    margins = [p["chosen_score"] - p["rejected_score"] for p in pairs]
    assert sum(counts["margin_histogram"]["counts"]) == len(pairs)
    assert counts["margin_histogram"]["edges"][0] <= min(margins) and counts["margin_histogram"]["edges"][-1] >= max(
        margins)
    dataset = Dataset.from_parquet(str(tmp_path / "out" / "pick" / "part-00000.parquet"))
    assert len(dataset) == len(pairs) and is_conversational(dataset[0])
    assert set(dataset.column_names) == {"id", "prompt", "chosen", "rejected", "chosen_score", "rejected_score",
                                         "finish_reason"}


def test_dpo_pairs_of_raw_prompts_are_trl_standard_format(tmp_path):
    from datasets import Dataset
    from trl.data_utils import is_conversational

    path, _ = _samples(tmp_path, as_messages=False)
    table, _ = _run(tmp_path, path, {"rule": "dpo_pairs", "prompt_column": "prompt"})
    first = table.to_pylist()[0]
    assert isinstance(first["prompt"], str) and isinstance(first["chosen"], str)
    assert not is_conversational(first)
    assert len(Dataset.from_parquet(str(tmp_path / "out" / "pick" / "part-00000.parquet"))) == table.num_rows


def test_best_of_n_appends_the_best_sample_as_the_assistant_turn(tmp_path):
    from trl.data_utils import is_conversational

    path, rows = _samples(tmp_path)
    table, record = _run(tmp_path, path, {"rule": "best_of_n", "messages_column": "messages",
                                          "where": "finish_reason = 'stop'"})
    stop_rows = {k: [v[i] for i in range(len(rows["id"])) if rows["finish_reason"][i] == "stop"] for k, v in rows.items()}
    scored = _by_prompt(stop_rows)
    out = table.to_pylist()
    assert len(out) == len(scored) == NUM_PROMPTS
    for row in out:
        best = max(r for r, _ in scored[row["id"]])
        first_best = next(text for r, text in scored[row["id"]] if r == best)  # ties: the earliest sample
        assert row["reward"] == best
        assert row["messages"][-1] == {"role": "assistant", "content": first_best}
        assert is_conversational(row)
    assert record.select["num_filtered_rows"] == NUM_PROMPTS  # the sample_index 3 rows (length)


def test_filter_keeps_the_rows_its_predicate_holds_for(tmp_path):
    path, rows = _samples(tmp_path)
    table, record = _run(tmp_path, path, {"rule": "filter", "where": "reward > 0.5 AND finish_reason = 'stop'"})
    expected = [(i, c) for i, c, r, f in zip(rows["id"], rows["completion"], rows["reward"], rows["finish_reason"])
                if r is not None and r > 0.5 and f == "stop"]
    assert list(zip(table["id"].to_pylist(), table["completion"].to_pylist())) == expected
    assert table.column_names == list(rows)
    assert record.select["num_output_rows"] == len(expected)


def test_a_rerun_finds_the_select_complete_and_a_changed_rule_makes_it_again(tmp_path):
    path, _ = _samples(tmp_path)
    _run(tmp_path, path, {"rule": "dpo_pairs"})
    part = tmp_path / "out" / "pick" / "part-00000.parquet"
    before = part.stat().st_mtime_ns
    [again] = run_staged_job(load_any_job(_job(tmp_path, path, {"rule": "dpo_pairs"})), progress=False)
    assert (again.num_units_run, again.is_replaced, part.stat().st_mtime_ns) == (0, False, before)
    [changed] = run_staged_job(load_any_job(_job(tmp_path, path, {"rule": "dpo_pairs", "min_margin": 1.0})),
                               progress=False)
    assert changed.is_replaced and changed.num_units_run == 1
    assert changed.record.select["num_below_margin"] > 0


def test_bad_select_settings_name_the_key(tmp_path):
    path, _ = _samples(tmp_path)
    with pytest.raises(JobError, match=r"select.where: .*cannot read"):
        load_any_job(_job(tmp_path, path, {"rule": "filter", "where": "reward >>> 1 AND"}))
    with pytest.raises(JobError, match="rule filter needs `where`"):
        load_any_job(_job(tmp_path, path, {"rule": "filter"}))
    with pytest.raises(JobError, match=r"select.score_column: column 'score' is not in"):
        _run(tmp_path, path, {"rule": "dpo_pairs", "score_column": "score"})
