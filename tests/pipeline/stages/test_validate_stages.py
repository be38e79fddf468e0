"""`batchgen validate` of a multi-stage job: every stage checked before any weight loads, a stage whose
input is not written yet checked against the columns its earlier stage will write, and each stage's
folder state (complete, to be made again) after a run (a FakeEngine run: no model)."""

from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

from batchgen.cli import main as cli
from batchgen.pipeline.stages import load_any_job
from batchgen.pipeline.stages.run import STAGES_NAME, run_staged_job
from tests.pipeline.conftest import FakeEngine, engine_sections, write_parquet

VERDICT = {"type": "object", "properties": {"score": {"type": "integer"}}, "required": ["score"]}


@pytest.fixture
def no_engine(monkeypatch):
    """validate must never load weights."""
    from batchgen.engine.runner import executor

    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(executor, "load_model", refuse)


@pytest.fixture
def model(tiny_model) -> str:
    """A tiny HF folder: its tokenizer files read in a fraction of the bundled GGUF's time."""
    return str(tiny_model)


def _job(tmp_path, model: str, **pairs) -> str:
    write_parquet(tmp_path / "prompts.parquet", {
        "id": [1, 2, 3], "messages": [[{"role": "user", "content": f"q{i}"}] for i in range(3)]})
    job = {"name": "pipe", "output": {"path": str(tmp_path / "out")}, **engine_sections(model=model),
           "sampling": {"max_tokens": 4},
           "stages": [
               {"name": "gen", "input": {"path": str(tmp_path / "prompts.parquet"), "messages_column": "messages"},
                "sampling": {"n": 2, "temperature": 1.0}},
               {"name": "judge", "input": {"stage": "gen", "prompt_template": "Rate: {{ completion }}"},
                "sampling": {"max_tokens": 16, "structured": {"json": VERDICT}}, "output": {"parse_json": True}},
               {"name": "pairs", "task": "select", "input": {"stage": "judge"},
                "select": {"rule": "dpo_pairs", "score_column": "score", "completion_column": "gen_completion",
                           **pairs}}]}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return str(path)


def _validate(path: str, *args: str):
    return CliRunner().invoke(cli.app, ["validate", path, *args])


def _stage_blocks(output: str) -> dict[str, str]:
    """validate's output per stage: {stage name: its lines}."""
    return {block.split(":", 1)[0].removeprefix("stage "): block for block in output.split("\n== ")[1:]}


def test_validate_checks_every_stage_before_any_runs_and_loads_no_weights(tmp_path, model, no_engine):
    result = _validate(_job(tmp_path, model))
    assert result.exit_code == 0, result.output
    blocks = _stage_blocks(result.stdout)
    assert list(blocks) == ["gen", "judge", "pairs"]
    assert "units    1 of <= 10,000 rows; 6 output rows (n=2)" in blocks["gen"] and ": new" in blocks["gen"]
    assert "stage gen's output (not written yet, or to be made again): columns completion checked" in blocks["judge"]
    assert "chat template: renders" in blocks["judge"]  # its model's files were read
    assert "columns  id, score, gen_completion checked against stage judge's output" in blocks["pairs"]
    assert result.stdout.rstrip().endswith("ok") and not (tmp_path / "out").exists()


def test_a_select_column_no_earlier_stage_writes_is_refused_naming_the_stage_and_key(tmp_path, model, no_engine):
    result = _validate(_job(tmp_path, model, score_column="rating"))
    assert result.exit_code == 2
    assert "stage 'pairs'" in result.output and "select.score_column" in result.output
    assert "'rating'" in result.output


def test_after_a_run_validate_shows_each_stage_complete_and_a_change_makes_every_later_one_again(tmp_path, model,
                                                                                                 no_engine):
    path = _job(tmp_path, model)
    staged = load_any_job(path)
    run_staged_job(staged, engine=FakeEngine(staged.stages[0].job.engine_config()), progress=False)
    manifest = json.loads((tmp_path / "out" / STAGES_NAME).read_text())
    assert [(s["name"], s["reads"], s["config_hash"]) for s in manifest["stages"]] == [
        ("gen", {"path": str(tmp_path / "prompts.parquet")}, staged.stages[0].identity),
        ("judge", {"stage": "gen"}, staged.stages[1].identity), ("pairs", {"stage": "judge"}, staged.stages[2].identity)]

    blocks = _stage_blocks(_validate(path).stdout)
    for name in ("gen", "judge", "pairs"):
        assert "complete (_SUCCESS present): a run has nothing to do" in blocks[name], blocks[name]
    assert "rows 0-5  (done)" in blocks["judge"]  # planned in full over gen's output

    changed = _validate(path, "--set", "sampling.max_tokens=5")  # every stage's settings change
    assert changed.exit_code == 0, changed.output
    blocks = _stage_blocks(changed.stdout)
    assert "made again" in blocks["gen"]
    assert "not written yet, or to be made again" in blocks["judge"]  # not planned over gen's old output
    assert "not written yet, or to be made again" in blocks["pairs"]
