"""`batchgen validate`, `--set`, `--help` and exit codes (0 done, 2 bad job or usage, 1 failure)."""

from __future__ import annotations

import pytest
import yaml
from typer.testing import CliRunner

from batchgen.cli import main as cli
from tests.pipeline.conftest import engine_sections, write_parquet


@pytest.fixture
def job_file(tmp_path):
    write_parquet(tmp_path / "data" / "in.parquet", {"id": list(range(5)), "prompt": [f"p{i}" for i in range(5)]})
    raw = {"name": "cli-job", **engine_sections(), "input": {"path": "data/in.parquet", "rows_per_unit": 2},
           "sampling": {"max_tokens": 4}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture
def no_engine(monkeypatch):
    """validate (and a run of a bad job) must never load weights."""
    from batchgen.engine.runner import executor

    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(executor, "load_model", refuse)


def invoke(*args: str):
    return CliRunner().invoke(cli.app, list(args))


def test_validate_prints_the_plan_and_loads_no_weights(job_file, no_engine, tmp_path):
    result = invoke("validate", str(job_file))
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "job      cli-job" in out and "smollm2-135m-instruct ->" in out
    assert "1 file(s), 5 rows" in out and "units    3 of <= 2 rows" in out
    assert "part-00000.parquet" in out and "rows 4-4" in out
    assert f"output   {tmp_path / 'out' / 'cli-job'}: new" in out and out.rstrip().endswith("ok")


def test_set_overrides_change_what_validate_plans(job_file, no_engine, tmp_path):
    result = invoke("validate", str(job_file), "--set", "input.rows_per_unit=5", "--set", "sampling.n=3",
                    "--set", "sampling.temperature=0.5", "--set", f"output.path={tmp_path / 'elsewhere'}")
    assert result.exit_code == 0, result.output
    assert "units    1 of <= 5 rows; 15 output rows (n=3)" in result.stdout
    assert f"{tmp_path / 'elsewhere'}: new" in result.stdout
    assert "units    2 of <= 2 rows" in invoke("validate", str(job_file), "--limit", "3").stdout


@pytest.mark.parametrize("args, expected", [
    (["--set", "sampling.temperature=-1"], "sampling.temperature: must be in [1e-5, 100] or 0 (got -1.0)"),
    (["--set", "input.prompt_column=text"], "column 'text' (input.prompt_column) is missing"),
    (["--set", "model.path=/nowhere/model.gguf"], "model.path"),
    (["--set", "nonsense"], "expected section.key=value"),
])
def test_bad_jobs_exit_2_naming_the_key(job_file, no_engine, args, expected):
    for command in ("validate", "run"):
        result = invoke(command, str(job_file), *args)
        assert result.exit_code == 2, (command, result.output)
        assert expected in result.stderr, (command, result.stderr)


def test_usage_errors_exit_2_and_failures_exit_1(job_file, monkeypatch):
    assert invoke("run").exit_code == 2  # missing argument
    assert invoke("run", str(job_file), "--limit", "0").exit_code == 2

    def explode(*args, **kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr("batchgen.pipeline.job.run_job", explode)
    result = invoke("run", str(job_file))
    assert result.exit_code == 1 and "disk on fire" in result.stderr


def test_help_explains_the_commands():
    top = invoke("--help")
    assert top.exit_code == 0 and "run" in top.stdout and "validate" in top.stdout
    run_help = invoke("run", "--help").stdout
    for option in ("--set", "--limit", "--overwrite", "--json"):
        assert option in run_help
