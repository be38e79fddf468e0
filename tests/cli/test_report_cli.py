"""`batchgen run --report`: a report that fails after a successful run is said on stderr and leaves the run's
exit code alone (a scheduler must not see a failed job); the page it writes leads with the job's scores
(a job's `metrics:` section; the fake engine's completions end in their sample index)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from typer.testing import CliRunner

import batchgen.report
from batchgen.cli import main as cli
from batchgen.metrics import metric_field
from batchgen.metrics.spec import RegexMatch
from tests.pipeline.conftest import FakeEngine, engine_sections, write_parquet
from tests.report.html_cells import keyed_cells


def _job(tmp_path, monkeypatch, **sections):
    from batchgen.pipeline import job_engine

    write_parquet(tmp_path / "data" / "in.parquet", {"id": list(range(5)), "prompt": [f"p{i}" for i in range(5)]})
    raw = {"name": "cli-report", **engine_sections(), "input": {"path": "data/in.parquet", "rows_per_unit": 2},
           "sampling": {"max_tokens": 4}, "output": {"path": "out"}, **sections}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(raw))
    monkeypatch.setattr(job_engine, "engine_for", lambda job, engine: FakeEngine(job.engine_config()))
    return tmp_path / "job.yaml"


def test_a_failed_report_keeps_the_runs_exit_code(tmp_path, monkeypatch):
    job = _job(tmp_path, monkeypatch)

    def broken(config):
        raise RuntimeError("the page could not be drawn")

    monkeypatch.setattr(batchgen.report, "write_report", broken)
    result = CliRunner().invoke(cli.app, ["run", str(job), "--report", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / "_SUCCESS").exists() and not (tmp_path / "out" / "report.html").exists()
    assert ("batchgen: the run succeeded (see _SUCCESS); its report failed: RuntimeError: the page could not be "
            "drawn") in result.stderr
    assert "its report failed" not in result.stdout


def test_the_run_report_leads_with_the_scores_its_parts_carry(tmp_path, monkeypatch):
    """The page `run --report` writes reads the verdict columns of the parts (here added to a finished run's
    parts as a job's metrics section writes them) and _SUCCESS's aggregates."""
    from batchgen.cli.report import write_run_report
    from batchgen.pipeline.config import load_job

    job = _job(tmp_path, monkeypatch)
    assert CliRunner().invoke(cli.app, ["run", str(job), "--no-progress"]).exit_code == 0
    spec = RegexMatch(type="regex_match", pattern="/0$")
    for part in sorted((tmp_path / "out").glob("part-*.parquet")):
        table = pq.read_table(part)
        verdicts = [float(text.endswith("/0")) for text in table.column("completion").to_pylist()]
        pq.write_table(table.append_column(metric_field("ends", spec), pa.array(verdicts, pa.float64())), part)
    success = json.loads((tmp_path / "out" / "_SUCCESS").read_text())
    (tmp_path / "out" / "_SUCCESS").write_text(json.dumps({**success, "metrics": {
        "ends": {"value": 1.0, "stderr": 0.0, "n": 5}}}))

    write_run_report(load_job(job, []))
    page = (tmp_path / "out" / "report.html").read_text()
    cells = keyed_cells(page, "scores-table")["ends"]
    assert cells[2] == "1.0000" and cells[-2:] == ["5", "job (_SUCCESS)"]


def test_run_report_shows_the_jobs_metrics_and_keeps_the_threshold_exit(tmp_path, monkeypatch):
    """Needs the job's `metrics:` section (pipeline: metric columns and _SUCCESS's metrics)."""
    metrics = {"first": {"type": "regex_match", "pattern": "/0$", "min": 0.9}}
    job = _job(tmp_path, monkeypatch, metrics=metrics, sampling={"max_tokens": 4, "n": 2, "temperature": 1.0})
    result = CliRunner().invoke(cli.app, ["run", str(job), "--report", "--no-progress"])
    assert result.exit_code == 3, result.output  # first is 0.5, below its min: the run's code, after the page
    success = json.loads((tmp_path / "out" / "_SUCCESS").read_text())["metrics"]["first"]
    assert success["value"] == 0.5 and success["n"] == 10
    cells = keyed_cells((tmp_path / "out" / "report.html").read_text(), "scores-table")["first"]
    assert cells[2] == "0.5000" and cells[-2:] == ["10", "job (_SUCCESS)"]
