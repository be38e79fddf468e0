"""The page of a select stage's output folder: its rule, counts and histograms from `_SUCCESS`'s `select` entry.

The folder is made by a real select stage (dpo_pairs over the stage tests' synthetic scored samples); the
expected counts and histogram are recomputed here from the input rows, not read back from `_SUCCESS`.
"""

from __future__ import annotations

import json
from collections import defaultdict

import numpy as np
import pytest

from batchgen.report import ReportConfig, build_report
from batchgen.report.config import ReportError
from tests.pipeline.stages.test_select_stage import NUM_PROMPTS, N, _job, _run, _samples
from tests.report.folders import row, write_run
from tests.report.html_cells import keyed_cells

MIN_MARGIN = 1.0


def _dpo_stage(tmp_path):
    path, rows = _samples(tmp_path)
    _run(tmp_path, path, {"rule": "dpo_pairs", "min_margin": MIN_MARGIN})
    return tmp_path / "out" / "pick", rows


def test_the_page_of_a_dpo_pairs_stage_shows_its_counts_and_histograms(tmp_path):
    folder, rows = _dpo_stage(tmp_path)
    html = build_report(ReportConfig(out=str(folder)))

    scored = defaultdict(list)
    for prompt, reward in zip(rows["id"], rows["reward"]):
        if reward is not None:
            scored[prompt].append(reward)
    spreads = [max(s) - min(s) for s in scored.values()]
    num_ties = sum(d == 0 for d in spreads)
    num_below = sum(0 < d < MIN_MARGIN for d in spreads)
    kept = [d for d in spreads if d >= MIN_MARGIN]
    assert num_ties and num_below and kept
    counts = {key: cells[-1] for key, cells in keyed_cells(html, "select-counts").items()}
    assert counts == {
        "rule": "dpo_pairs", "num_input_rows": str(NUM_PROMPTS * N), "num_prompts": str(NUM_PROMPTS),
        "num_filtered_rows": "0", "num_unscored_rows": str(sum(r is None for r in rows["reward"])),
        "num_single_sample": "0", "num_ties": str(num_ties), "num_below_margin": str(num_below),
        "num_output_rows": str(len(kept))}

    every_score = [r for r in rows["reward"] if r is not None]
    want_counts, _ = np.histogram(every_score, bins=10)
    scores = keyed_cells(html, "select-score-histogram")
    assert [int(cells[-1]) for cells in scores.values()] == list(want_counts)
    assert list(scores)[0].startswith("[-1, ") and list(scores)[-1].endswith(", 2]")  # closed last bin
    margins = keyed_cells(html, "select-margin-histogram")
    assert sum(int(cells[-1]) for cells in margins.values()) == len(kept)
    assert list(margins)[0].startswith(f"[{min(kept):g}, ") and list(margins)[-1].endswith(f", {max(kept):g}]")
    percentiles = dict(zip(["p0", "p100"], [min(kept), max(kept)]))
    shown = html.split('id="select-margin-percentiles"')[1].split("</table>")[0]
    for name, value in percentiles.items():
        assert f'data-key="{name}">{value:.4g}</td>' in shown
    assert "_SUCCESS says" not in html  # num_requests (prompts read) is not the part files' row count


def test_a_select_entry_reaches_the_page_escaped_and_integer_scores_get_one_bin_each(tmp_path):
    folder, _ = _dpo_stage(tmp_path)
    success = json.loads((folder / "_SUCCESS").read_text())
    success["select"]["rule"] = "<script>alert(1)</script>"
    success["select"]["score_histogram"] = {"edges": [0.5, 1.5, 2.5, 3.5], "counts": [3, 0, 7]}
    (folder / "_SUCCESS").write_text(json.dumps(success))
    html = build_report(ReportConfig(out=str(folder)))
    assert "<script>alert(1)</script>" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert {k: v[-1] for k, v in keyed_cells(html, "select-score-histogram").items()} == {"1": "3", "2": "0", "3": "7"}


def test_a_model_runs_page_has_no_select_section(tmp_path):
    write_run(str(tmp_path / "run"), [row(i) for i in range(3)])
    html = build_report(ReportConfig(out=str(tmp_path / "run")))
    assert 'id="summary-table"' in html and 'id="select"' not in html


def test_a_select_stages_page_leaves_out_what_only_a_model_run_has(tmp_path):
    folder, _ = _dpo_stage(tmp_path)
    html = build_report(ReportConfig(out=str(folder)))
    summary = {key: cells[-1] for key, cells in keyed_cells(html, "summary-table").items()}
    assert set(summary) == {"job", "config_hash", "num_requests", "num_rows", "generation_seconds", "provenance"}
    assert summary["num_requests"] == str(NUM_PROMPTS) and "prompts read" in html  # not "requests"
    assert set(keyed_cells(html, "parts-table")) == {"parts", "rows"}  # no token or request counts of zero
    for section in ('id="latency-table"', 'id="finish-reasons"', 'id="plots"', 'id="slowest"', 'id="failed"',
                    'id="scores"'):
        assert section not in html, section


def test_against_refuses_a_select_stages_folder(tmp_path):
    folder, _ = _dpo_stage(tmp_path)
    with pytest.raises(ReportError, match=r"--against compares two model runs' rows .* a select stage's output"):
        build_report(ReportConfig(out=str(folder), against=str(folder)))
    with pytest.raises(ReportError, match=r"multi-stage job's folder: .*--against compares one stage's output "
                                          r"folder with another's: .*out/pick$"):
        build_report(ReportConfig(out=str(tmp_path / "out"), against=str(tmp_path / "out")))


def test_batchgen_run_report_writes_each_stages_page_and_the_jobs_page_linking_them(tmp_path):
    """`batchgen run --report` of a multi-stage job: the select stage's page, and at the top the job's page
    with every stage in order, its state and counts, and each select stage's section."""
    from typer.testing import CliRunner

    from batchgen.cli import main as cli

    path, rows = _samples(tmp_path)
    job = _job(tmp_path, path, {"rule": "dpo_pairs", "min_margin": MIN_MARGIN})
    result = CliRunner().invoke(cli.app, ["run", job, "--no-progress", "--report"])
    assert result.exit_code == 0, result.output
    out = tmp_path / "out"
    stage_page = (out / "pick" / "report.html").read_text()
    assert 'id="select-counts"' in stage_page and 'id="latency-table"' not in stage_page
    page = (out / "report.html").read_text()
    [cells] = keyed_cells(page, "stages-table").values()
    num_output = json.loads((out / "pick" / "_SUCCESS").read_text())["select"]["num_output_rows"]
    assert cells[:5] == ["pick", "select dpo_pairs", f"path {path}", "complete", str(num_output)]
    assert 'href="pick/report.html"' in page
    counts = {key: v[-1] for key, v in keyed_cells(page, "select-counts-pick").items()}
    assert counts["num_prompts"] == str(NUM_PROMPTS) and counts["num_output_rows"] == str(num_output)
    assert "Select stage pick: dpo_pairs" in page

    # a changed rule: the job's page says the folder holds other settings' output until the next run
    changed = _job(tmp_path, path, {"rule": "dpo_pairs", "min_margin": 2 * MIN_MARGIN})
    from batchgen.pipeline.stages import load_any_job
    from batchgen.pipeline.stages.run import write_stages_manifest

    write_stages_manifest(load_any_job(changed))
    [cells] = keyed_cells(build_report(ReportConfig(out=str(out))), "stages-table").values()
    assert cells[3] == "complete, other settings"
    shown = CliRunner().invoke(cli.app, ["report", str(out), "-o", str(tmp_path / "job.html")])
    assert shown.exit_code == 0 and "each stage's scores are on its own page" in shown.output
    assert 'id="stages-table"' in (tmp_path / "job.html").read_text()
