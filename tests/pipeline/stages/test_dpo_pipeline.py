"""Issue 42, criterion 2: one three-stage job (run_staged_job, what `batchgen run` calls, on the session's
engine: no second load of the bundled model): the bundled model
samples n = 4 answers to 100 chat prompts -> `task: reward` scores every sample with a tiny random
one-label reward model -> `task: select` rule dpo_pairs with a min_margin. Every pair's chosen is the max
and rejected the min of its prompt's rewards as stage 2 wrote them, margins >= min_margin, every dropped
prompt counted as the select stage reports it, and the output passes TRL's conversational check and loads
as a datasets.Dataset."""

from __future__ import annotations

from collections import defaultdict

import pyarrow.parquet as pq
import pytest
import yaml

from batchgen.pipeline.stages import load_any_job
from batchgen.pipeline.stages.run import run_staged_job
from tests.pipeline.conftest import engine_sections, read_output, write_parquet
from tests.tiny_reward import tiny_reward_model  # noqa: F401  (a fixture)

pytestmark = pytest.mark.slow  # 400 samples of 4 tokens on the bundled model, then 400 scored rows

NUM_PROMPTS, N, MIN_MARGIN = 100, 4, 1.0
TOPICS = ("rain", "ships", "bread", "hills", "stars", "rivers", "salt", "bridges", "owls", "maps")


def _job_file(tmp_path, reward_model) -> str:
    prompts = write_parquet(tmp_path / "prompts.parquet", {
        "id": [f"p{i}" for i in range(NUM_PROMPTS)],
        "messages": [[{"role": "user", "content": f"Say one thing about {TOPICS[i % 10]} ({i})."}]
                     for i in range(NUM_PROMPTS)]})
    job = {"name": "dpo-pipeline", "output": {"path": str(tmp_path / "out")},
           **engine_sections(),  # the session engine's settings: the generate stage runs on it
           "stages": [
               {"name": "generate", "input": {"path": str(prompts), "messages_column": "messages"},
                "sampling": {"n": N, "temperature": 1.0, "max_tokens": 4, "seed": 11}},
               {"name": "score", "task": "reward", "input": {"stage": "generate"},
                "model": {"path": str(reward_model), "dtype": "float32", "max_model_len": 256}},
               {"name": "pairs", "task": "select", "input": {"stage": "score"},
                # the defaults read `reward` and `completion`: a reward stage keeps the sample it scored
                # under its own name (it writes no completion of its own)
                "select": {"rule": "dpo_pairs", "min_margin": MIN_MARGIN}}]}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return str(path)


def test_three_stage_dpo_pipeline(tmp_path, engine, tiny_reward_model):  # noqa: F811
    from datasets import Dataset
    from trl.data_utils import is_conversational

    _, reward_model = tiny_reward_model
    results = run_staged_job(load_any_job(_job_file(tmp_path, reward_model)), engine=engine, progress=False)
    records = {r.stage.name: r.record.to_dict() for r in results}
    out = tmp_path / "out"
    assert all((out / stage / "_SUCCESS").exists() for stage in ("generate", "score", "pairs"))

    scored = read_output(out / "score").to_pylist()
    assert len(scored) == NUM_PROMPTS * N and all(row["error"] is None for row in scored)
    by_prompt = defaultdict(list)
    for row in scored:
        by_prompt[row["id"]].append((row["reward"], row["completion"], row["messages"]))
    assert len(by_prompt) == NUM_PROMPTS and all(len(s) == N for s in by_prompt.values())

    pairs_path = out / "pairs" / "part-00000.parquet"
    pairs = pq.read_table(pairs_path).to_pylist()
    assert pairs, "random rewards of distinct samples: some prompts must give a pair"
    for pair in pairs:
        samples = by_prompt[pair["id"]]
        best, worst = max(samples, key=lambda s: s[0]), min(samples, key=lambda s: s[0])
        assert pair["chosen_score"] == pytest.approx(best[0]) and pair["rejected_score"] == pytest.approx(worst[0])
        assert pair["chosen_score"] - pair["rejected_score"] >= MIN_MARGIN
        messages = [{"role": m["role"], "content": m["content"]} for m in best[2]]
        assert [dict(m) for m in pair["prompt"]] == messages
        assert pair["chosen"] == [{"role": "assistant", "content": best[1]}]
        assert pair["rejected"] == [{"role": "assistant", "content": worst[1]}]

    # every prompt not paired is counted, each under its reason, exactly as recomputed from stage 2's rewards
    margins = {i: max(s)[0] - min(s)[0] for i, s in by_prompt.items()}
    counts = records["pairs"]["select"]
    assert counts["num_ties"] == sum(m == 0 for m in margins.values())
    assert counts["num_below_margin"] == sum(0 < m < MIN_MARGIN for m in margins.values())
    assert counts["num_below_margin"] > 0, "min_margin chosen so that it drops some prompts"
    assert len(pairs) == sum(m >= MIN_MARGIN and m > 0 for m in margins.values())
    assert len(pairs) + counts["num_ties"] + counts["num_below_margin"] + counts["num_single_sample"] == NUM_PROMPTS

    assert all(is_conversational(row) for row in pairs)
    dataset = Dataset.from_parquet(str(pairs_path))
    assert dataset.num_rows == len(pairs) and {"prompt", "chosen", "rejected"} <= set(dataset.column_names)
