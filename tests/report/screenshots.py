"""The screenshots of `batchgen report` in docs/guides/evaluation.md: both modes on real runs of the bundled
model.

    python -m tests.report.screenshots [--keep DIR]     # writes docs/report.png, docs/report-against.png

Runs jobs/data/chat_prompts.parquet (48 chat prompts, a category column) greedy, then again with a
`temperature` column at 1.0 for every sixth id, reports the first run alone (--by category) and the
second against the first, and photographs both pages in headless Chromium (tests/report/browser.py).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.engine import LLMEngine
from batchgen.pipeline.config import validate_job
from batchgen.pipeline.job import run_job
from batchgen.report import ReportConfig, write_report
from tests.report.browser import Browser

REPO = Path(__file__).resolve().parents[2]
VIEW = (1280, 1900)  # the top of the page: summary, comparison and the first plots


def _job(folder: Path, name: str, input_path: Path, **extra) -> object:
    raw = {"name": name, "model": {"path": "smollm2-135m-instruct", "max_model_len": 1024},
           "engine": {"kv_cache_memory": "256MiB"},
           "input": {"path": str(input_path), "prompt_column": None, "messages_column": "messages",
                     "rows_per_unit": 8},
           "sampling": {"temperature": 0.0, "max_tokens": 48, "seed": 1},
           "output": {"path": str(folder / name), "keep_columns": ["category"]}, **extra}
    return validate_job(raw, folder)


def _shrink(path: Path) -> None:
    """64 colors without dithering: text and plots stay crisp, the file a third of the size."""
    from PIL import Image  # pillow comes with matplotlib

    image = Image.open(path).convert("RGB")
    image.quantize(colors=64, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(path, optimize=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", help="run the jobs here and keep their outputs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="batchgen-screenshots-") as scratch:
        folder = Path(args.keep or scratch)
        folder.mkdir(parents=True, exist_ok=True)
        table = pq.read_table(REPO / "jobs" / "data" / "chat_prompts.parquet")
        ids = table.column("id").to_pylist()
        warm = table.append_column("temperature", pa.array([1.0 if k % 6 == 0 else 0.0 for k in range(len(ids))]))
        pq.write_table(table, folder / "prompts.parquet")
        pq.write_table(warm, folder / "prompts-warm.parquet")
        nightly = _job(folder, "nightly", folder / "prompts.parquet")
        tonight = _job(folder, "nightly-warm", folder / "prompts-warm.parquet",
                       sampling_columns={"temperature": "temperature"})
        engine = LLMEngine(nightly.engine_config())  # one engine for both: the same settings
        run_job(nightly, engine=engine, progress=True)
        run_job(tonight, engine=engine, progress=True)
        single = write_report(ReportConfig(out=str(folder / "nightly"), by="category",
                                           output=str(folder / "report.html")))
        against = write_report(ReportConfig(out=str(folder / "nightly-warm"), against=str(folder / "nightly"),
                                            by="category", output=str(folder / "report-against.html")))
        browser = Browser(*VIEW)
        try:
            for page_path, png in ((single, "report.png"), (against, "report-against.png")):
                page = browser.open(Path(page_path).resolve().as_uri())
                assert page.console_errors() == []
                page.screenshot(REPO / "docs" / png, full_page=False)
                _shrink(REPO / "docs" / png)
                print(f"wrote docs/{png}")
        finally:
            browser.close()


if __name__ == "__main__":
    main()
