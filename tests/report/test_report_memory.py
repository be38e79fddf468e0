"""`batchgen report --against` on two synthetic runs of 400,000 rows each (the real output schema, null
completions) in a fresh process: its peak memory grows by less than 300 MB over its resident size after
imports, and the page still counts every row. (1M rows: docs/benchmarks/history/serving-report-scoring.md,
`python -m batchgen.bench.report_memory`.)"""

from __future__ import annotations

import pytest

from batchgen.bench.report_memory import run_measured, write_synthetic_run
from tests.report.html_cells import keyed_cells

pytestmark = pytest.mark.subprocess

NUM_ROWS = 400_000
MAX_GROWTH_MB = 300


def test_report_against_in_bounded_memory(tmp_path):
    run = write_synthetic_run(str(tmp_path / "run"), NUM_ROWS)
    baseline = write_synthetic_run(str(tmp_path / "baseline"), NUM_ROWS, seed=1, changed_share=0.1,
                                   dropped_share=0.01)
    page = tmp_path / "page.html"
    measured = run_measured(str(tmp_path / "run"), str(tmp_path / "baseline"), "category", str(page))
    assert measured["growth_mb"] < MAX_GROWTH_MB, measured

    counts = {key: int(cells[-1].replace(",", "")) for key, cells in keyed_cells(page.read_text(),
                                                                                 "comparison-counts").items()}
    kept = NUM_ROWS - baseline["num_dropped"]
    assert counts == {"identical": kept - baseline["num_changed"], "different": baseline["num_changed"],
                      "only_new": baseline["num_dropped"], "only_old": 0}
    assert run["success"].num_rows == NUM_ROWS
