"""The stage graph: checked before anything runs (naming the stage and key), each stage resumes on its own,
and a stage's identity includes the stages it reads (a FakeEngine: no model, milliseconds)."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import yaml

from batchgen.pipeline.config import JobConfig, load_job
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.stages import StagedJob, load_any_job
from batchgen.pipeline.stages.run import run_staged_job
from tests.pipeline.conftest import FakeEngine, engine_sections, write_parquet


def _prompts(tmp_path):
    return write_parquet(tmp_path / "prompts.parquet", {
        "id": [1, 2, 3], "messages": [[{"role": "user", "content": f"q{i}"}] for i in range(3)]})


def _three_stages(tmp_path) -> dict:
    return {"name": "pipe", "output": {"path": str(tmp_path / "out")}, **engine_sections(),
            "sampling": {"max_tokens": 4},
            "stages": [
                {"name": "gen", "input": {"path": str(_prompts(tmp_path)), "messages_column": "messages"},
                 "sampling": {"n": 2, "temperature": 1.0}},
                {"name": "judge", "input": {"stage": "gen"}, "sampling": {"max_tokens": 3}},
                {"name": "keep", "task": "select", "input": {"stage": "judge"},
                 "select": {"rule": "filter", "where": "gen_sample_index = 1"}}]}


def _write(tmp_path, job: dict) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return str(path)


def _run(path: str, *overrides: str):
    staged = load_any_job(path, list(overrides))
    engine = FakeEngine(staged.stages[0].job.engine_config())
    return {r.stage.name: r for r in run_staged_job(staged, engine=engine, progress=False)}


def _mtimes(tmp_path) -> dict[str, int]:
    return {p.parent.name: p.stat().st_mtime_ns for p in (tmp_path / "out").glob("*/part-*.parquet")}


def test_each_stage_reads_the_last_and_keeps_its_columns(tmp_path):
    results = _run(_write(tmp_path, _three_stages(tmp_path)))
    assert [r.num_units_run for r in results.values()] == [1, 1, 1]
    judge = pq.read_table(tmp_path / "out" / "judge" / "part-00000.parquet")
    # the judge's own completion, and the judged sample's as gen_completion; the prompt carried on
    assert {"completion", "gen_completion", "gen_sample_index", "messages"} <= set(judge.column_names)
    assert judge.num_rows == 6 and judge["gen_completion"].to_pylist()[:2] == ["done 1/0", "done 1/1"]
    kept = pq.read_table(tmp_path / "out" / "keep" / "part-00000.parquet")
    assert kept["gen_sample_index"].to_pylist() == [1, 1, 1]
    assert results["judge"].record.job == "pipe/judge"


def test_a_rerun_recomputes_nothing_and_a_change_reruns_only_what_depends_on_it(tmp_path):
    path = _write(tmp_path, _three_stages(tmp_path))
    _run(path)
    first = _mtimes(tmp_path)
    again = _run(path)
    assert [r.num_units_run for r in again.values()] == [0, 0, 0] and _mtimes(tmp_path) == first

    changed = _run(path, "stages.keep.select.where=gen_sample_index = 0")
    assert [r.is_replaced for r in changed.values()] == [False, False, True]
    now = _mtimes(tmp_path)
    assert (now["gen"], now["judge"]) == (first["gen"], first["judge"]) and now["keep"] != first["keep"]

    changed = _run(path, "stages.judge.sampling.max_tokens=2")
    assert [r.is_replaced for r in changed.values()] == [False, True, True]
    assert _mtimes(tmp_path)["gen"] == first["gen"]

    changed = _run(path, "stages.gen.sampling.seed=5")
    assert [r.is_replaced for r in changed.values()] == [True, True, True]


def test_top_level_sections_are_defaults_a_stage_overrides(tmp_path):
    staged = load_any_job(_write(tmp_path, _three_stages(tmp_path)))
    gen, judge, _ = staged.stages
    assert (gen.job.sampling.max_tokens, gen.job.sampling.n) == (4, 2)
    assert (judge.job.sampling.max_tokens, judge.job.sampling.n) == (3, 1)
    assert judge.job.input.messages_column == "messages" and judge.job.input.allow_duplicate_ids
    assert judge.job.output.path == str(tmp_path / "out" / "judge") + "/"
    assert judge.identity != load_any_job(_write(tmp_path, {**_three_stages(tmp_path), "sampling": {
        "max_tokens": 4, "seed": 9}})).stages[1].identity  # a changed earlier stage changes this one


def test_a_job_without_stages_loads_as_before(tmp_path):
    raw = {"name": "one", **engine_sections(), "sampling": {"max_tokens": 4},
           "input": {"path": str(_prompts(tmp_path)), "messages_column": "messages"}}
    path = _write(tmp_path, raw)
    job = load_any_job(path)
    assert isinstance(job, JobConfig) and not isinstance(job, StagedJob)
    assert job.config_hash() == load_job(path).config_hash()


@pytest.mark.parametrize("change, message", [
    (lambda j: j["stages"][1]["input"].update(stage="nope"), r"stage 'judge': input.stage: no stage named 'nope'"),
    (lambda j: j["stages"][0].update(input={"stage": "keep"}),
     r"stages: the stages read each other in a cycle: gen -> keep -> judge -> gen"),
    (lambda j: j["stages"][2].update(name="gen"), r"stages\[2\].name: 'gen' names two stages"),
    (lambda j: j["stages"][2].update(select={"rule": "dpo_pairs"}),
     r"stage 'keep'.*select.score_column: column 'reward' is not in the output of stage 'judge'"),
    (lambda j: j["stages"][2].update(select={"rule": "best_of_n", "score_column": "score"}),
     r"stage 'keep'.*select.score_column: column 'score' is not in the output of stage 'judge'"),
    (lambda j: j["stages"][2].update(select={"rule": "filter", "where": "score > 1"}),
     r"stage 'keep'.*select.where: column 'score' is not in the output of stage 'judge'"),
    (lambda j: j["stages"][1].update(sampling={"n": 0}), r"stage 'judge': invalid stage\n  sampling.n"),
    (lambda j: j["stages"][2].update(model={"path": "x"}), r"stage 'keep': model: not a key of a select stage"),
    (lambda j: j.update(input={"path": "x"}), r"input: not a key of a multi-stage job's top level"),
    (lambda j: j["stages"][1].update(output={"path": "elsewhere"}), r"stage 'judge': output.path: a stage's output"),
])
def test_a_bad_graph_is_refused_before_anything_runs_naming_the_stage_and_key(tmp_path, change, message):
    job = _three_stages(tmp_path)
    change(job)
    with pytest.raises(JobError, match=message):
        load_any_job(_write(tmp_path, job))
    assert not (tmp_path / "out").exists()


def test_stages_share_an_engine_with_the_same_settings_and_release_it_before_another_loads(tmp_path, monkeypatch):
    import batchgen.pipeline.stages.run as stage_run

    events = []

    class Engine(FakeEngine):
        def shutdown(self):
            events.append(("shutdown", self.config.max_num_seqs))

    real_engine_for = stage_run.engine_for

    def engine_for(job, engine):
        if engine is not None:
            return real_engine_for(job, engine)  # ValueError when the settings differ
        events.append(("load", job.engine_config().max_num_seqs))
        return Engine(job.engine_config())

    monkeypatch.setattr(stage_run, "engine_for", engine_for)
    job = _three_stages(tmp_path)
    job["stages"].insert(2, {"name": "judge2", "input": {"stage": "judge"}, "engine": {"max_num_seqs": 8}})
    job["stages"][3]["input"] = {"stage": "judge2"}
    run_staged_job(load_any_job(_write(tmp_path, job)), progress=False)
    default = job["stages"][0].get("engine", {}).get("max_num_seqs", FakeEngine(
        load_any_job(_write(tmp_path, job)).stages[0].job.engine_config()).config.max_num_seqs)
    # gen and judge share one engine; judge2's other settings load another after the first is shut down
    assert events == [("load", default), ("shutdown", default), ("load", 8), ("shutdown", 8)]


@pytest.mark.parametrize("rule", ["dpo_pairs", "best_of_n"])
def test_the_first_stages_system_prompt_opens_the_selected_prompts(tmp_path, rule):
    """The samples were generated after input.system_prompt: the training rows carry it (a raw prompt's
    pairs then take TRL's conversational format, the only one that holds a system turn)."""
    from trl.data_utils import is_conversational

    prompts = write_parquet(tmp_path / "raw.parquet", {"id": [1, 2], "text": ["q1", "q2"]})
    job = {"name": "sys", "output": {"path": str(tmp_path / "out")}, **engine_sections(),
           "sampling": {"max_tokens": 4},
           "stages": [
               {"name": "gen", "input": {"path": str(prompts), "prompt_column": "text",
                                         "system_prompt": "Be brief."}, "sampling": {"n": 2, "temperature": 1.0}},
               {"name": "pick", "task": "select", "input": {"stage": "gen"},
                "select": {"rule": rule, "score_column": "sample_index"}}]}
    staged = load_any_job(_write(tmp_path, job))
    assert staged.by_name["pick"].is_messages  # what a later stage reading "pick" sees
    run_staged_job(staged, engine=FakeEngine(staged.stages[0].job.engine_config()), progress=False)
    rows = pq.read_table(tmp_path / "out" / "pick" / "part-00000.parquet").to_pylist()
    system, user = {"role": "system", "content": "Be brief."}, {"role": "user", "content": "q1"}
    if rule == "dpo_pairs":
        assert rows[0]["prompt"] == [system, user]
        assert rows[0]["chosen"] == [{"role": "assistant", "content": "done 1/1"}]  # sample_index 1 > 0
        assert rows[0]["rejected"] == [{"role": "assistant", "content": "done 1/0"}]
    else:
        assert rows[0]["messages"] == [system, user, {"role": "assistant", "content": "done 1/1"}]
    assert all(is_conversational(row) for row in rows)


def test_a_reward_stage_keeps_the_scored_sample_as_completion_and_renames_only_what_it_writes(tmp_path):
    """A reward stage writes no completion: the sample it scored keeps its name, so a dpo_pairs stage after
    it reads the defaults (`reward`, `completion`); the columns it does write push the earlier ones aside."""
    job = _three_stages(tmp_path)
    job["stages"][1:] = [
        {"name": "score", "task": "reward", "input": {"stage": "gen"}},
        {"name": "pairs", "task": "select", "input": {"stage": "score"}, "select": {"rule": "dpo_pairs"}}]
    staged = load_any_job(_write(tmp_path, job))
    score = staged.by_name["score"]
    assert {"completion", "reward", "sample_index", "finish_reason", "error", "gen_sample_index",
            "gen_finish_reason", "gen_error", "messages"} <= set(score.columns)
    assert "gen_completion" not in score.columns
    assert score.job.output.rename_columns == {"sample_index": "gen_sample_index",
                                               "finish_reason": "gen_finish_reason", "error": "gen_error"}
    assert staged.by_name["pairs"].select.completion_column == "completion"


def test_shard_is_refused_for_a_multi_stage_job_and_its_workaround_runs(tmp_path):
    """--shard with stages: exit 2 naming why, before anything runs; the way round it the message gives (a
    sharded single job, then the stages from its folder) reads that folder as an earlier stage's output."""
    from typer.testing import CliRunner

    from batchgen.cli import main as cli
    from batchgen.pipeline.job import run_job

    job = _three_stages(tmp_path)
    result = CliRunner().invoke(cli.app, ["run", _write(tmp_path, job), "--shard", "0/2", "--no-progress"])
    assert result.exit_code == 2
    assert "each stage reads the whole committed output of the stage before it" in result.output
    assert "cluster.backend: ray" in result.output and not (tmp_path / "out").exists()

    first = {"name": "gen", **engine_sections(), "input": job["stages"][0]["input"],
             "sampling": {"max_tokens": 4, "n": 2, "temperature": 1.0},
             "output": {"path": str(tmp_path / "gen"), "keep_columns": ["messages"]}}
    config = load_job(_write(tmp_path, first))
    run_job(config, engine=FakeEngine(config.engine_config()), progress=False)  # (sharded, in real life)
    rest = {**job, "stages": [
        {"name": "judge", "input": {"path": str(tmp_path / "gen"), "messages_column": "messages",
                                    "allow_duplicate_ids": True}, "output": {"keep_columns": ["completion"],
                                                                             "rename_columns": {"completion": "gen_completion"}}},
        {"name": "keep", "task": "select", "input": {"stage": "judge"},
         "select": {"rule": "filter", "where": "gen_completion IS NOT NULL"}}]}
    results = _run(_write(tmp_path, rest))
    assert results["keep"].record.num_rows == 6  # 3 prompts x 2 samples, each judged once
