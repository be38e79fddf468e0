"""`batchgen report` on a real job of the bundled model, rendered in headless Chromium: no console
error, every plot drawn, and the page's figures equal `_SUCCESS`'s and the part files' own."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from batchgen.report import ReportConfig, write_report
from tests.pipeline.conftest import read_output
from tests.report.conftest import ROWS, assert_plots_drawn, column_texts, open_page, table_by_key

pytestmark = pytest.mark.browser

SINGLE_RUN_PLOTS = ["ttft", "tpot", "e2e", "lengths", "throughput", "finish", "categories"]


def _int(text: str) -> int:
    return int(text.replace(",", ""))


def _text(text: str, unit: str) -> str:
    assert text.endswith(unit), text
    return text.removesuffix(unit).strip()


def _number(text: str, unit: str) -> float:
    return float(_text(text, unit).replace(",", ""))


def test_report_of_a_real_run_in_chromium(greedy_run, browser, tmp_path):
    finished_run = greedy_run.out
    page_path = Path(write_report(ReportConfig(out=str(finished_run), by="category",
                                               output=str(tmp_path / "report.html"))))
    page = open_page(browser, page_path)
    assert page.console_errors() == []
    assert_plots_drawn(page, SINGLE_RUN_PLOTS)

    success = json.loads((finished_run / "_SUCCESS").read_text())
    shown = table_by_key(page, "summary-table")
    assert shown["job"] == success["job"] and shown["config_hash"] == success["config_hash"]
    assert shown["model"] == success["model"] == "smollm2-135m-instruct"
    for key in ("num_requests", "num_rows", "num_errors", "prompt_tokens", "cached_tokens", "completion_tokens"):
        assert _int(shown[key].split()[0]) == success[key], key  # cached tokens: then their share
    assert _number(shown["generation_seconds"], "s") == pytest.approx(success["generation_seconds"], abs=0.005)
    assert float(shown["completion_tokens_per_s"].replace(",", "")) == pytest.approx(
        success["completion_tokens_per_s"], abs=0.05)
    for name in ("ttft_s", "tpot_s"):  # "p50 / p90 / p99 ms"
        shown_ms = [float(v.replace(",", "")) for v in _text(shown[name], "ms").split(" / ")]
        assert shown_ms == pytest.approx([success[name][q] * 1000 for q in ("p50", "p90", "p99")], abs=0.05)
    for key, value in success["kernels"].items():
        assert f"{key} {value}" in shown["kernels"]
    assert shown["workers"] == "local" and shown["resumed"] == "no"
    assert page.evaluate("document.querySelector('#warnings')") is None  # the parts agree with _SUCCESS

    # The part files' figures, counted here with pyarrow.
    rows = read_output(finished_run).to_pylist()
    parts = table_by_key(page, "parts-table")
    assert _int(parts["parts"]) == 3 and _int(parts["rows"]) == len(rows) == len(ROWS)
    reasons = Counter(r["finish_reason"] for r in rows)
    shown_reasons = dict(zip(column_texts(page, "#finish-reasons td:nth-child(1)"),
                             map(_int, column_texts(page, "#finish-reasons td:nth-child(2)"))))
    assert shown_reasons == dict(reasons)
    categories = Counter(r["category"] for r in rows)
    shown_categories = dict(zip(column_texts(page, "#category-table td:nth-child(1)"),
                                map(_int, column_texts(page, "#category-table td:nth-child(2)"))))
    assert shown_categories == dict(categories)
    slowest = column_texts(page, "#slowest-rows td.id")
    assert slowest[0] == str(max(rows, key=lambda r: r["e2e_s"])["id"]) and len(slowest) == len(rows)
    assert sorted(map(int, slowest)) == sorted(r["id"] for r in rows)

    png = page.screenshot(tmp_path / "report.png")
    assert png.startswith(b"\x89PNG") and int.from_bytes(png[16:20], "big") == 1280
