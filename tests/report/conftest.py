"""Report test helpers: one headless Chromium for the session, and readers of a rendered page's DOM."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchgen.pipeline.job import run_job
from tests.pipeline.conftest import PIPELINE_ENGINE_KWARGS, engine_sections, make_job, write_parquet
from tests.report.browser import Browser, Page

# What the tests read from a loaded page, in the page (the rendered DOM), as JSON.
# A plot's data marks are the SVG elements plots.py names <plot>-data-<k>; a drawn one has an area.
_PLOTS_JS = """[...document.querySelectorAll('figure.plot')].map(f => {
  const svg = f.querySelector('svg'); const box = svg ? svg.getBoundingClientRect() : {width: 0, height: 0};
  const marks = svg ? [...svg.querySelectorAll(`[id^="${f.dataset.plot}-data-"]`)] : [];
  const drawn = marks.filter(m => { const b = m.getBoundingClientRect(); return b.width > 0 && b.height > 0; });
  return {name: f.dataset.plot, width: box.width, height: box.height, marks: marks.length, drawn: drawn.length,
          text: svg ? svg.textContent : ''};
})"""


def table_by_key(page: Page, table_id: str, column: int = 1) -> dict[str, str]:
    """{data-key: the shown text of cell `column`} for the rows of a table."""
    return page.evaluate(f"""Object.fromEntries([...document.querySelectorAll('#{table_id} tr[data-key]')]
        .map(tr => [tr.dataset.key, tr.children[{column}].textContent.trim()]))""")


def column_texts(page: Page, selector: str) -> list[str]:
    return page.evaluate(f"[...document.querySelectorAll({selector!r})].map(e => e.textContent.trim())")


def plots(page: Page) -> list[dict]:
    return page.evaluate(_PLOTS_JS)


def assert_plots_drawn(page: Page, names: list[str]) -> None:
    """Each named plot is on the page, drawn at a real size, with data marks and no placeholder text."""
    found = plots(page)
    assert [p["name"] for p in found] == names
    for p in found:
        assert p["width"] > 300 and p["height"] > 100, p
        assert p["drawn"] >= 1, p  # a bar, a filled histogram, a step line: data, not just axes
        assert "no values" not in p["text"] and "no rows" not in p["text"], p


# The session model's weights with a small KV pool: report tests run a few short prompts.
REPORT_ENGINE_KWARGS = {**PIPELINE_ENGINE_KWARGS, "kv_cache_memory": "64MiB"}


@pytest.fixture(scope="session")
def report_engine(llm):
    """The engine of every real job in these tests (jobs built with report_job)."""
    return llm.with_engine_settings(max_model_len=REPORT_ENGINE_KWARGS["max_model_len"],
                                    kv_cache_memory=REPORT_ENGINE_KWARGS["kv_cache_memory"]).engine


def report_job(tmp_path: Path, input_path: str, **sections):
    """make_job on report_engine's settings."""
    return make_job(tmp_path, input_path, **engine_sections(REPORT_ENGINE_KWARGS), **sections)


REPO = Path(__file__).resolve().parents[2]
CHAT_PROMPTS = REPO / "jobs" / "data" / "chat_prompts.parquet"
ROWS = [0, 5, 12, 13, 20, 27, 33, 41]  # eight chat prompts of several categories
GREEDY_RUN = {"input": {"prompt_column": None, "messages_column": "messages", "rows_per_unit": 3},
              "sampling": {"temperature": 0.0, "max_tokens": 6, "seed": 5}}


@dataclass
class Run:
    folder: Path  # the job's folder (its input file inside)
    input: Path
    out: Path


@pytest.fixture(scope="session")
def greedy_run(tmp_path_factory, report_engine) -> Run:
    """A real greedy chat job over eight prompts in three units, the category kept: the run the page tests
    report on, and the baseline of the comparison tests."""
    tmp = tmp_path_factory.mktemp("greedy-run")
    path = write_parquet(tmp / "chat.parquet", pq.read_table(CHAT_PROMPTS).take(ROWS))
    job = report_job(tmp, str(path), **GREEDY_RUN, output={"path": str(tmp / "out"), "keep_columns": ["category"]})
    run_job(job, engine=report_engine, progress=False)
    return Run(tmp, path, tmp / "out")


@pytest.fixture(scope="session")
def browser():
    b = Browser()
    yield b
    b.close()


def open_page(browser: Browser, path: Path) -> Page:
    return browser.open(Path(path).resolve().as_uri())
