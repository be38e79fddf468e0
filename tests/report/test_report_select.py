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
from tests.pipeline.stages.test_select_stage import NUM_PROMPTS, N, _run, _samples
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


def test_a_multi_stage_jobs_top_folder_is_refused_naming_its_stage_folders(tmp_path):
    _dpo_stage(tmp_path)
    with pytest.raises(ReportError, match=r"multi-stage job's folder: report one stage's output folder, .*out/pick$"):
        build_report(ReportConfig(out=str(tmp_path / "out")))
