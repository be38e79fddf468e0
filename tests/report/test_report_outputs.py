"""The report over the other output layouts (static shards, OpenAI batch files) and from the command line:
`batchgen report` and `batchgen run --report` (a fake engine: the layouts, not the model, are the point)."""

from __future__ import annotations

import json

import pyarrow as pa
import yaml
from typer.testing import CliRunner

from batchgen.cli import main as cli
from batchgen.pipeline.job import run_job
from batchgen.report import ReportConfig, build_report
from tests.pipeline.conftest import FakeEngine, engine_sections, make_job, write_parquet
from tests.pipeline.test_openai_batch import batch_job, mixed_lines, write_lines
from tests.report.folders import row, write_run
from tests.report.html_cells import keyed_cells


def _shown(html: str, table: str) -> dict[str, str]:
    return {key: cells[-1] for key, cells in keyed_cells(html, table).items()}


def test_a_sharded_output(tmp_path):
    from batchgen.pipeline.shards import ShardSpec, run_shard

    path = write_parquet(tmp_path / "in.parquet", {"id": list(range(7)), "prompt": [f"p{i}" for i in range(7)]})
    job = make_job(tmp_path, str(path), input={"rows_per_unit": 2})
    for index in (1, 0):
        run_shard(job, ShardSpec(index, 2, "--shard"), engine=FakeEngine(job.engine_config()), progress=False)
    html = build_report(ReportConfig(out=str(tmp_path / "out")))
    summary = _shown(html, "summary-table")
    assert summary["workers"] == "2 static shards" and summary["num_rows"] == "7"
    assert _shown(html, "parts-table")["parts"] == "4" and 'id="warnings"' not in html


def test_an_openai_batch_output(tmp_path):
    job = batch_job(tmp_path, write_lines(tmp_path / "in.jsonl", mixed_lines(12)), input={"rows_per_unit": 5})
    run_job(job, engine=FakeEngine(job.engine_config()), progress=False)
    out = tmp_path / "out"
    html = build_report(ReportConfig(out=str(out)))
    parts = _shown(html, "parts-table")
    for name in ("output.jsonl", "errors.jsonl"):
        assert parts[name] == f"{len((out / name).read_text().splitlines())} lines"
    assert parts["errors.jsonl"] == "2 lines" and 'id="warnings"' not in html
    assert html.count('<td class="id">r2</td>') == 1 and html.count('<td class="id">r5</td>') == 1  # failed rows


def test_run_with_report_writes_the_page_beside_success(tmp_path, monkeypatch):
    from batchgen.pipeline import job_engine

    write_parquet(tmp_path / "data" / "in.parquet", {"id": list(range(5)), "prompt": [f"p{i}" for i in range(5)]})
    raw = {"name": "cli-report", **engine_sections(), "input": {"path": "data/in.parquet", "rows_per_unit": 2},
           "sampling": {"max_tokens": 4}, "output": {"path": "out"}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(raw))
    monkeypatch.setattr(job_engine, "engine_for", lambda job, engine: FakeEngine(job.engine_config()))
    result = CliRunner().invoke(cli.app, ["run", str(tmp_path / "job.yaml"), "--report", "--no-progress"])
    assert result.exit_code == 0, result.output
    page = (tmp_path / "out" / "report.html").read_text()
    success = json.loads((tmp_path / "out" / "_SUCCESS").read_text())
    assert _shown(page, "summary-table")["config_hash"] == success["config_hash"]
    assert f"report written to {tmp_path / 'out' / 'report.html'}" in result.output


def test_the_report_command(tmp_path):
    write_run(str(tmp_path / "a"), [row(1, "x"), row(2, "y")])
    write_run(str(tmp_path / "b"), [row(1, "x"), row(2, "z")])
    write_run(str(tmp_path / "c"), [row("1"), row("2")], id_type=pa.string())
    runner = CliRunner()
    page = tmp_path / "page.html"
    done = runner.invoke(cli.app, ["report", str(tmp_path / "a"), "--against", str(tmp_path / "b"), "-o", str(page)])
    assert done.exit_code == 0, done.output
    assert _shown(page.read_text(), "comparison-counts") == {"identical": "1", "different": "1", "only_new": "0",
                                                              "only_old": "0"}
    bad = runner.invoke(cli.app, ["report", str(tmp_path / "a"), "--by", "topic", "-o", str(page)])
    assert bad.exit_code == 2 and "batchgen report: --by topic:" in bad.output
    other = runner.invoke(cli.app, ["report", str(tmp_path / "a"), "--against", str(tmp_path / "c"), "-o", str(page)])
    assert other.exit_code == 2 and "different prompt sets" in other.output
