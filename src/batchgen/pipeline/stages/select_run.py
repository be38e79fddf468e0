"""Run a select stage: read the earlier stage's committed parts, apply the rule, commit one part and `_SUCCESS`.

A select stage is a job of its own for integrity, like a model stage: the folder's lock, its manifest
(the stage's identity and its input's fingerprint), one part with its commit record, `_SUCCESS` last.
It loads no model and is cheap, so it is one unit: a rerun either finds it complete or does it again.
"""

from __future__ import annotations

import logging
import time

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.pipeline.errors import JobError
from batchgen.pipeline.input_file import InputFile
from batchgen.pipeline.output import (
    IdChecksum,
    OutputFolder,
    RunIdentity,
    WorkUnit,
    fingerprint_files,
    open_run,
)
from batchgen.pipeline.reader import inspect_file, list_input_files
from batchgen.pipeline.run_record import Percentiles, RunRecord, Workers
from batchgen.pipeline.stages.select_rules import select_rows
from batchgen.pipeline.stages.spec import Stage, StagedJob
from batchgen.pipeline.storage import Storage

log = logging.getLogger("batchgen.pipeline")


def select_identity(stage: Stage, staged: StagedJob) -> tuple[Storage, list[InputFile], RunIdentity]:
    """The stage's input files and what its folder records: its identity, their fingerprint, its one unit."""
    storage = Storage(stage.input_path, staged.storage_options)
    files = [inspect_file(storage, path) for path in list_input_files(storage)]
    whole = InputFile(storage.root, storage.url, sum(f.num_rows for f in files), files[0].schema)
    unit = WorkUnit(0, whole, 0, whole.num_rows)
    return storage, files, RunIdentity(stage_job_name(staged, stage), stage.identity,
                                       fingerprint_files(storage, files), [unit])


def stage_job_name(staged: StagedJob, stage: Stage) -> str:
    """The name a stage's folder records: `<job>/<stage>`."""
    return f"{staged.name}/{stage.name}"


def select_state(stage: Stage, staged: StagedJob):
    """The stage folder's state for this identity (for `validate` and the replace decision)."""
    _, _, identity = select_identity(stage, staged)
    folder = OutputFolder(Storage(stage.output_path, staged.storage_options))
    return folder.state(identity.config_hash, identity.fingerprint, identity.units), identity


def run_select_stage(stage: Stage, staged: StagedJob, *, overwrite: bool) -> tuple[RunRecord, bool]:
    """Run (or find complete) a select stage; its run record and whether this call ran it."""
    storage, files, identity = select_identity(stage, staged)
    out = Storage(stage.output_path, staged.storage_options)
    with open_run(out, identity, overwrite=overwrite) as run:
        if run.is_complete:
            return run.read_success(), False
        started = time.monotonic()
        frame = pl.from_arrow(_read_all(storage, files))
        prompt_column, is_messages = _prompt_column(stage, frame.columns)
        _check_columns(stage, frame.columns, prompt_column)
        system_prompt = stage.system_prompt_read if prompt_column == stage.prompt_column_read else None
        table, counts = select_rows(frame, stage.select, prompt_column, is_messages, system_prompt)
        arrow = table.to_arrow()
        unit = identity.units[0]
        part = out.open_part(unit.output_name)
        try:
            pq.write_table(arrow, part.path)
        except BaseException:
            part.abort()
            raise
        ids = IdChecksum()
        ids.update(arrow.column("id") if arrow.num_rows else pa.array([]))
        run.commit_context().commit_unit(out, part, unit, arrow.num_rows, ids.hexdigest())
        record = RunRecord(
            job=identity.job_name, config_hash=identity.config_hash, num_requests=counts.num_prompts,
            num_rows=arrow.num_rows, num_errors=0, prompt_tokens=0, cached_tokens=0, completion_tokens=0,
            generation_seconds=time.monotonic() - started, completion_tokens_per_s=0.0, ttft_s=Percentiles(),
            tpot_s=Percentiles(), resumed=False, workers=Workers.local(), select=counts.to_dict())
        run.finish(record)
        return record, True


def _read_all(storage: Storage, files: list[InputFile]) -> pa.Table:
    tables = []
    for file in files:
        with storage.fs.open(file.path, "rb") as f:
            tables.append(pq.read_table(f))
    return pa.concat_tables(tables, promote_options="permissive")


def _prompt_column(stage: Stage, columns: list[str]) -> tuple[str | None, bool]:
    """The prompt column the rule reads: the stage's (set or carried), else for a path input a column
    named `messages` (chat) or `prompt` (raw text)."""
    if stage.prompt_column_read is not None:
        return stage.prompt_column_read, stage.is_messages_read
    for name, is_messages in (("messages", True), ("prompt", False)):
        if name in columns:
            return name, is_messages
    return None, False


def _check_columns(stage: Stage, columns: list[str], prompt_column: str | None) -> None:
    """The rule's columns are in what it read (a path input is only known now): JobError naming the key."""
    wanted = stage.select.columns_read()
    if stage.select.rule != "filter":
        if prompt_column is None:
            raise JobError(f"stage {stage.name!r}: select.prompt_column: no prompt column is known for "
                           f"{stage.input_path} (no messages or prompt column); set select.prompt_column or "
                           "select.messages_column")
        wanted.setdefault(prompt_column, "the prompt column carried from the earlier stages")
    for column, key in wanted.items():
        if column not in columns:
            raise JobError(f"stage {stage.name!r}: {key}: column {column!r} is not in {stage.input_path} "
                           f"(its columns: {', '.join(columns)})")
