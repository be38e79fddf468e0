"""run_job: plan, check, start the engine, stream rows through it into unit files, write _SUCCESS."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import pyarrow.parquet as pq

from batchgen.engine import EngineConfig, LLMEngine, RequestOutput
from batchgen.pipeline.config import JobConfig
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.feeder import Feeder
from batchgen.pipeline.id_scan import repeat_key
from batchgen.pipeline.lock import FolderLock, lock_folder
from batchgen.pipeline.output_folder import SUCCESS_NAME, describe_redo, raise_if_refused
from batchgen.pipeline.preflight import JobPlan, plan_job
from batchgen.pipeline.progress import Progress
from batchgen.pipeline.reader import read_rows
from batchgen.pipeline.requests import RequestBuilder, RowTask
from batchgen.pipeline.rows import decode_batch
from batchgen.pipeline.summary import SUMMARY_COLUMNS, Totals, success_record
from batchgen.pipeline.units import WorkUnit, contiguous_runs
from batchgen.pipeline.writer import CommitContext, UnitWriter

log = logging.getLogger("batchgen.pipeline")


@dataclass
class RunResult:
    record: dict  # the _SUCCESS contents
    success_path: str
    num_units_run: int
    num_units_skipped: int
    redone: dict[str, str] = field(default_factory=dict)  # unit files run again -> why they were not trusted


def run_job(job: JobConfig, *, engine: LLMEngine | None = None, limit: int | None = None,
            overwrite: bool = False, progress: bool = True) -> RunResult:
    """Run a job to completion (or resume it). Raises JobError for a bad job before any generation.

    The run holds its output folder's lock from before it touches the folder until it returns; a
    second run on the same folder raises LockHeld (a JobError) naming this one.
    `engine`: an already-built engine whose config equals the job's (tests and notebooks reuse one);
    None builds one from the job's model and engine sections.
    """
    plan = plan_job(job, limit)
    if not overwrite:
        raise_if_refused(plan.state)  # before the lock: nothing is written into a folder that is not ours
    with lock_folder(plan.output.storage) as lock:
        return _run_locked(plan, lock, engine, overwrite, progress)


def _run_locked(plan: JobPlan, lock: FolderLock, engine: LLMEngine | None, overwrite: bool,
                progress: bool) -> RunResult:
    job = plan.job
    # Read the folder again under the lock: another run may have finished units since plan_job looked.
    state = plan.output.prepare(job.name, plan.config_hash, plan.inputs.fingerprint, plan.units, overwrite)
    plan.state = state
    success_path = plan.output.storage.join(SUCCESS_NAME)
    if plan.is_complete:
        log.info("%s is complete (_SUCCESS present); nothing to do", job.output.path)
        return RunResult(plan.output.read_success(), success_path, 0, len(plan.units))
    pending = plan.pending_units
    skipped = [u for u in plan.units if u.output_name in state.done_names]
    if state.redo:
        log.warning("%s", describe_redo(state.redo))
    if skipped:
        log.info("resuming: skipping %d finished unit(s) (%s); %d to run", len(skipped),
                 ", ".join(u.output_name for u in skipped), len(pending))
    engine = _engine_for(job, engine)
    _check_engine_can_run(job, engine)

    this_run = Totals()
    writer = UnitWriter(plan.output.storage, plan.inputs.output_schema(job),
                        [job.input.id_column, *job.output.keep_columns], job.sampling.n,
                        CommitContext(plan.config_hash, lock.holder.run_id, lock.check), on_rows=this_run.add_table)
    bar = Progress(engine, sum(u.num_rows for u in pending), job.name, enabled=progress)

    def on_output(task: RowTask, out: RequestOutput) -> None:
        writer.add_output(task, out)
        bar.advance(1, sum(len(c.token_ids) for c in out.outputs))

    def on_error(task: RowTask) -> None:
        writer.add_error(task)
        bar.advance(1)

    feeder = Feeder(engine, _iter_tasks(plan, pending, RequestBuilder(job, engine), writer),
                    window=job.batching.window, sort_by_length=job.batching.sort_by_length,
                    max_in_flight=2 * engine.config.max_num_seqs, on_output=on_output, on_error=on_error)
    try:
        feeder.run()
    except BaseException:
        writer.abort()  # unfinished parts leave no temp file behind
        raise
    finally:
        bar.close()
    if writer.num_open_units:  # every row was handed back, so every unit must have been written
        raise RuntimeError(f"{writer.num_open_units} unit(s) were not completed")

    whole = dataclasses.replace(this_run, ttft_s=[], tpot_s=[])  # latency figures: this run only
    for unit in skipped:  # counts cover the whole output, also what an earlier run wrote
        path = plan.output.storage.join(unit.output_name)
        with plan.output.storage.fs.open(path, "rb") as f:
            whole.add_table(pq.read_table(f, columns=SUMMARY_COLUMNS))
    record = success_record(job.name, plan.config_hash, whole, this_run, feeder.generation_seconds,
                            resumed=bool(skipped), kernels=engine.stats["kernels"],
                            weights=engine.stats.get("weights", {}))
    lock.check()
    plan.output.write_success(record)
    return RunResult(record, success_path, len(pending), len(skipped), dict(state.redo))


def _engine_for(job: JobConfig, engine: LLMEngine | None) -> LLMEngine:
    wanted = job.engine_config()
    if engine is not None:
        differing = _differing_fields(wanted, engine.config)
        if differing:
            raise ValueError(f"the engine passed in was built with other settings than the job's: {differing}")
        return engine
    try:
        return LLMEngine(wanted)
    except (ValueError, FileNotFoundError) as exc:  # settings that cannot work (KV cache too small, ...)
        raise JobError(f"cannot start the engine for {job.model.path}: {exc}") from None


def _differing_fields(a: EngineConfig, b: EngineConfig) -> str:
    names = [f.name for f in dataclasses.fields(a) if f.compare and getattr(a, f.name) != getattr(b, f.name)]
    return ", ".join(f"{n}: job {getattr(a, n)!r} vs engine {getattr(b, n)!r}" for n in names)


def _check_engine_can_run(job: JobConfig, engine: LLMEngine) -> None:
    if job.input.apply_chat_template and not engine.tokenizer.has_chat_template:
        raise JobError(f"model.path: {job.model.path} has no chat template; set input.apply_chat_template: "
                       "false and use prompt_column (raw prompts)")


def _iter_tasks(plan: JobPlan, units: list[WorkUnit], builder: RequestBuilder,
                writer: UnitWriter) -> Iterator[RowTask]:
    """Every pending row as a RowTask, in input order; each unit's id/kept columns go to the writer."""
    job = plan.job
    columns = list(dict.fromkeys([job.input.id_column, job.input.text_column, *job.sampling_columns.values(),
                                  *job.output.keep_columns]))
    for run in contiguous_runs(units):
        file = run[0].file
        position = run[0].start
        unit_iter = iter(run)
        unit = next(unit_iter)
        writer.open_unit(unit)
        for batch in read_rows(plan.input_storage, file, run[0].start, run[-1].stop, columns):
            while batch.num_rows:
                if position == unit.stop:
                    unit = next(unit_iter)
                    writer.open_unit(unit)
                piece = batch.slice(0, min(batch.num_rows, unit.stop - position))
                batch = batch.slice(piece.num_rows)
                writer.add_source(unit.index, piece)
                first_offset = position - unit.start
                position += piece.num_rows
                for i, row in enumerate(decode_batch(piece, job)):
                    task = builder.build(row, unit.index, first_offset + i)
                    occurrence = plan.repeats.get((file.path, unit.start + first_offset + i))
                    if occurrence and task.request_id is not None:
                        task.request_id = repeat_key(task.request_id, occurrence)
                    yield task
