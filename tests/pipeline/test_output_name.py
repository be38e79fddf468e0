"""The default output folder out/<name> stays inside out/: a name that is not one folder name is refused."""

from __future__ import annotations

import os

import pytest
import yaml
from typer.testing import CliRunner

from batchgen.cli.main import app
from batchgen.pipeline.config import load_job, validate_job
from batchgen.pipeline.errors import JobError

BASE = {"model": {"path": "smollm2-135m-instruct"}, "input": {"path": "in.parquet"}}


@pytest.mark.parametrize("name", ["../../x", "..", ".", "a/b", "/etc/x", "a\\b", "x\0y"])
def test_names_that_would_leave_out_are_refused_without_output_path(tmp_path, name):
    with pytest.raises(JobError, match=r"name: .* cannot name the default output folder out/<name>.*output\.path"):
        validate_job({"name": name, **BASE}, tmp_path)


@pytest.mark.parametrize("name", ["nightly-eval", "nightly eval", "v1.2_final", "..x", "x.."])
def test_plain_names_land_in_out(tmp_path, name):
    job = validate_job({"name": name, **BASE}, tmp_path)
    assert job.output.path == str(tmp_path / "out" / name)
    assert os.path.dirname(os.path.normpath(job.output.path)) == str(tmp_path / "out")


def test_any_name_is_fine_with_an_explicit_output_path(tmp_path):
    job = validate_job({"name": "../../x", **BASE, "output": {"path": "results"}}, tmp_path)
    assert job.output.path == str(tmp_path / "results") and job.name == "../../x"


def test_the_cli_refuses_it_as_a_bad_job(tmp_path):
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump({"name": "../../escaped", **BASE}))
    with pytest.raises(JobError):
        load_job(job_file)
    result = CliRunner().invoke(app, ["validate", str(job_file)])
    assert result.exit_code == 2 and "output.path" in result.output, result.output
    result = CliRunner().invoke(app, ["validate", str(job_file), "--set", "name=../../escaped"])
    assert result.exit_code == 2
    assert not (tmp_path.parent.parent / "escaped").exists()
