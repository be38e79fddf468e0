"""The multi-stage example jobs as committed: they validate, and they run end to end (one prompt, short
samples) on the shared engine, every stage writing what the next one reads."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
from trl.data_utils import is_conversational

from batchgen.pipeline.stages import StagedJob, load_any_job
from batchgen.pipeline.stages.run import run_staged_job
from tests.pipeline.conftest import engine_sections
from tests.tiny_reward import tiny_reward_model  # noqa: F401  (a fixture)

pytestmark = pytest.mark.slow  # two three-stage runs on the bundled model, the judges constrained to JSON

JOBS = Path(__file__).resolve().parents[3] / "jobs"
FINAL = {"judge_dpo": ("pairs", ["id", "prompt", "chosen", "rejected", "chosen_score", "rejected_score"]),
         "best_of_n_sft": ("best", ["id", "messages", "score"])}


@pytest.mark.parametrize("name", sorted(FINAL))
def test_example_stage_jobs_validate_and_run(tmp_path, engine, name):
    staged = load_any_job(JOBS / f"{name}.yaml")
    assert isinstance(staged, StagedJob) and [s.name for s in staged.stages][:2] == ["generate", "judge"]
    sections = engine_sections()
    overrides = [f"{section}.{key}={value}" for section in ("model", "engine") for key, value in sections[section].items()]
    staged = load_any_job(JOBS / f"{name}.yaml", [*overrides, f"output.path={tmp_path}",
                                                  "stages.generate.sampling.max_tokens=8"], limit=1)
    results = {r.stage.name: r for r in run_staged_job(staged, engine=engine, progress=False)}
    assert all(r.num_units_run == 1 for r in results.values()) and all((tmp_path / s / "_SUCCESS").exists() for s in results)

    judge = pq.read_table(tmp_path / "judge" / "part-00000.parquet")
    assert judge.num_rows == 4  # one prompt's n = 4 samples, each judged
    assert judge.schema.field("score").type == "int64" and judge.schema.field("reason").type == "string"
    assert {"generate_completion", "generate_finish_reason"} <= set(judge.column_names)
    for row in judge.to_pylist():  # a finished answer always parses (the constraint), a cut one gives nulls
        assert (row["score"] in range(1, 6)) if row["finish_reason"] == "stop" else True

    stage, columns = FINAL[name]
    final = pq.read_table(tmp_path / stage / "part-00000.parquet")
    assert final.column_names[:len(columns)] == columns and final.num_rows <= 1
    assert all(is_conversational(row) for row in final.to_pylist())


def test_the_reward_model_dpo_example_validates_and_runs(tmp_path, engine, tiny_reward_model):  # noqa: F811
    """jobs/dpo_pipeline.yaml with its Hub reward model replaced by the tiny local one (no network here)."""
    _, reward_model = tiny_reward_model
    staged = load_any_job(JOBS / "dpo_pipeline.yaml")
    assert isinstance(staged, StagedJob) and [s.name for s in staged.stages] == ["generate", "score", "pairs"]
    sections = engine_sections()
    overrides = [f"{section}.{key}={value}" for section in ("model", "engine") for key, value in sections[section].items()]
    staged = load_any_job(JOBS / "dpo_pipeline.yaml", [
        *overrides, f"output.path={tmp_path}", "stages.generate.sampling.max_tokens=8",
        f"stages.score.model.path={reward_model}", "stages.score.model.max_model_len=256",
        "stages.pairs.select.min_margin=0"], limit=1)
    results = {r.stage.name: r for r in run_staged_job(staged, engine=engine, progress=False)}
    assert all(r.num_units_run == 1 for r in results.values()) and all((tmp_path / s / "_SUCCESS").exists() for s in results)

    score = pq.read_table(tmp_path / "score" / "part-00000.parquet")
    assert score.num_rows == 4 and score.schema.field("reward").type == "float"  # one prompt's 4 samples
    rewards = score.column("reward").to_pylist()
    final = pq.read_table(tmp_path / "pairs" / "part-00000.parquet").to_pylist()
    assert len(final) == (1 if max(rewards) > min(rewards) else 0)
    for row in final:
        assert (row["chosen_score"], row["rejected_score"]) == pytest.approx((max(rewards), min(rewards)))
        assert is_conversational(row)
