"""`batchgen report --against` on real runs of one prompt set: a run with a known subset of ids sampled at
a high temperature (a sampling column) lists exactly those ids as different, at the token positions
where the outputs part; a run over fewer rows lists the others as missing."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.pipeline.job import run_job
from batchgen.report import ReportConfig, write_report
from tests.pipeline.conftest import read_output, write_parquet
from tests.report.conftest import (
    GREEDY_RUN,
    ROWS,
    assert_plots_drawn,
    column_texts,
    open_page,
    report_job,
    table_by_key,
)

pytestmark = pytest.mark.browser

COMPARE_PLOTS = ["ttft", "tpot", "e2e", "lengths", "throughput", "finish", "first_token", "categories"]
WARM_POSITIONS = (1, 4)  # the rows sampled at temperature 2
NUM_SHORT = 6  # rows of the limited run


@pytest.fixture(scope="module")
def warm_run(greedy_run, report_engine, tmp_path_factory) -> tuple[Path, set[int]]:
    tmp = tmp_path_factory.mktemp("warm-run")
    table = pq.read_table(greedy_run.input)
    ids = table.column("id").to_pylist()
    warm = {ids[i] for i in WARM_POSITIONS}
    table = table.append_column("temperature", pa.array([2.0 if i in warm else 0.0 for i in ids]))
    path = write_parquet(tmp / "chat_warm.parquet", table)
    job = report_job(tmp, str(path), **GREEDY_RUN, sampling_columns={"temperature": "temperature"},
                     output={"path": str(tmp / "out"), "keep_columns": ["category"]})
    run_job(job, engine=report_engine, progress=False)
    return tmp / "out", warm


@pytest.fixture(scope="module")
def short_run(greedy_run, report_engine, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("short-run")
    job = report_job(tmp, str(greedy_run.input), **GREEDY_RUN,
                     output={"path": str(tmp / "out"), "keep_columns": ["category"]})
    run_job(job, engine=report_engine, limit=NUM_SHORT, progress=False)
    return tmp / "out"


def first_differing_tokens(new: Path, old: Path) -> dict[int, int]:
    """{id: first position where the token lists differ} for the rows whose tokens differ, by a plain loop."""
    old_rows = {r["id"]: r["completion_token_ids"] for r in read_output(old).to_pylist()}
    found = {}
    for r in read_output(new).to_pylist():
        a, b = r["completion_token_ids"], old_rows[r["id"]]
        if a != b:
            found[r["id"]] = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return found


def test_against_lists_exactly_the_ids_sampled_warm(greedy_run, warm_run, browser, tmp_path):
    out, warm = warm_run
    expected = first_differing_tokens(out, greedy_run.out)
    assert set(expected) == warm  # the premise: temperature 2 changed those rows, greedy ones are identical

    page = open_page(browser, write_report(ReportConfig(out=str(out), against=str(greedy_run.out), by="category",
                                                        output=str(tmp_path / "against.html"))))
    assert page.console_errors() == []
    assert_plots_drawn(page, COMPARE_PLOTS)
    counts = table_by_key(page, "comparison-counts")
    assert counts == {"identical": str(len(ROWS) - len(warm)), "different": str(len(warm)), "only_new": "0",
                      "only_old": "0"}
    ids = [int(i) for i in column_texts(page, "#different-rows td.id")]
    positions = [int(p) for p in column_texts(page, "#different-rows td:nth-child(3)")]
    assert ids == sorted(warm) and dict(zip(ids, positions)) == expected
    assert sorted(int(d) for d in page.evaluate(
        "[...document.querySelectorAll('.diff')].map(d => d.dataset.id)")) == sorted(warm)
    assert page.evaluate("document.querySelectorAll('.diff mark').length") >= len(warm)
    differences = table_by_key(page, "config-differences")
    assert "config_hash" in differences and "input files" in differences  # sampling_columns and the file changed
    assert "model" not in differences and "kernels.device" not in differences
    figures = table_by_key(page, "comparison-figures", column=1)
    assert figures["num_rows"] == str(len(ROWS)) == table_by_key(page, "comparison-figures", column=2)["num_rows"]
    page.screenshot(tmp_path / "against.png")


def test_against_a_shorter_run_lists_the_missing_ids(greedy_run, short_run, browser, tmp_path):
    page = open_page(browser, write_report(ReportConfig(out=str(short_run), against=str(greedy_run.out),
                                                        output=str(tmp_path / "short.html"))))
    assert page.console_errors() == []
    ids = pq.read_table(greedy_run.input).column("id").to_pylist()
    counts = table_by_key(page, "comparison-counts")
    assert counts == {"identical": str(NUM_SHORT), "different": "0", "only_new": "0",
                      "only_old": str(len(ROWS) - NUM_SHORT)}
    assert [int(i) for i in column_texts(page, "#only-old .id")] == sorted(ids[NUM_SHORT:])
    assert page.evaluate("document.querySelector('#only-new')") is None
    assert page.evaluate("document.querySelector('#different-rows').textContent") == "None."
