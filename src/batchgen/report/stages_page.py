"""The page of a multi-stage job's output folder (`output.path`, holding `_stages.json` and a folder per
stage): every stage in run order, what it read, its counts from its `_SUCCESS`, each select stage's
counts, score histogram and pair margins, and a link to the stage's own page where one was written.

Read from the records only (`_stages.json`, each stage's `_SUCCESS`): no part file is opened, so the
page of a job of millions of rows costs a few small reads.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass

import jinja2

from batchgen.pipeline.errors import JobError
from batchgen.pipeline.output import REPORT_NAME, SUCCESS_NAME
from batchgen.pipeline.run_record import RecordError, RunRecord
from batchgen.pipeline.run_record_text import count, rate, seconds
from batchgen.pipeline.stages.run import STAGES_NAME
from batchgen.pipeline.storage import Storage
from batchgen.report.config import ReportConfig, ReportError
from batchgen.report.select_stage import SelectFigures, select_figures


@dataclass
class StageRow:
    """One stage as the page shows it."""

    name: str
    what: str  # "generate with <model>", "select dpo_pairs", ...
    reads: str  # "stage gen" or "path <input>"
    config_hash: str
    folder: str  # the stage's folder name under the job's folder
    record: RunRecord | None  # its _SUCCESS; None: not finished (or not run yet)
    is_current: bool  # its _SUCCESS's config hash is the one _stages.json names
    has_report: bool  # the folder holds its own report.html (linked)
    select: SelectFigures | None = None

    @property
    def cells(self) -> dict[str, str]:
        """The figures of the stages table: '' where the stage has none (a select stage's tokens)."""
        r = self.record
        if r is None:
            return {}
        is_model = r.select is None
        return {"rows": count(r.num_rows), "errors": count(r.num_errors) if is_model else "",
                "prompt_tokens": count(r.prompt_tokens) if is_model else "",
                "completion_tokens": count(r.completion_tokens) if is_model and r.completion_tokens else "",
                "seconds": seconds(r.generation_seconds),
                "tokens_per_s": rate(r.completion_tokens_per_s) if is_model and r.completion_tokens else ""}


def is_stages_folder(url: str, storage_options: dict | None = None) -> bool:
    """The folder is a multi-stage job's output.path (it holds `_stages.json`)."""
    try:
        storage = Storage(url, storage_options)
        return storage.fs.exists(storage.join(STAGES_NAME))
    except (JobError, OSError):
        return False  # RunFolder says what is wrong with it


def render_stages_page(config: ReportConfig, env: jinja2.Environment) -> str:
    """The job's page's HTML (page.py's environment: autoescaped, its filters)."""
    storage = Storage(config.out, config.storage_options)
    manifest = _read_json(storage, STAGES_NAME)
    stages = manifest.get("stages")
    if not isinstance(stages, list) or not all(isinstance(s, dict) for s in stages):
        raise ReportError(f"{storage.join(STAGES_NAME)}: `stages` is not a list of stages")
    rows = [_stage_row(config.out.rstrip("/"), config.storage_options, entry) for entry in stages]
    return env.get_template("stages.html.j2").render(
        job=manifest.get("job"), url=config.out, stages=rows, report_name=REPORT_NAME,
        generated=datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"))


def _stage_row(job_url: str, storage_options: dict, entry: dict) -> StageRow:
    folder = str(entry.get("folder") or entry.get("name"))
    storage = Storage(f"{job_url}/{folder}", storage_options)
    names = set(storage.list_names())
    record = None
    if SUCCESS_NAME in names:
        try:
            record = RunRecord.from_dict(_read_json(storage, SUCCESS_NAME))
        except RecordError as exc:
            raise ReportError(f"{storage.join(SUCCESS_NAME)}: {exc}") from None
    reads = entry.get("reads") or {}
    task = str(entry.get("task"))
    what = f"select {entry.get('rule')}" if task == "select" else (
        f"{task} with {record.model}" if record is not None and record.model else task)
    config_hash = str(entry.get("config_hash") or "")
    return StageRow(
        name=str(entry.get("name")), what=what,
        reads=f"stage {reads['stage']}" if "stage" in reads else f"path {reads.get('path')}",
        config_hash=config_hash, folder=folder, record=record,
        is_current=record is not None and record.config_hash == config_hash,
        has_report=REPORT_NAME in names, select=select_figures(record))


def _read_json(storage: Storage, name: str) -> dict:
    try:
        value = json.loads(storage.read_text(name))
    except (OSError, ValueError) as exc:
        raise ReportError(f"{storage.join(name)} is unreadable ({exc})") from None
    if not isinstance(value, dict):
        raise ReportError(f"{storage.join(name)} is not a JSON object")
    return value
