"""Run a list of work units through one engine into their part files: the loop every placement shares.

A local run, a static shard and a Ray replica all call `run_units`; they differ only in which units
they are given and in who writes `_SUCCESS`. That is why a row's output never depends on where it ran.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pyarrow as pa

from batchgen.engine import LLMEngine, RequestOutput, ScoreOutput
from batchgen.pipeline.batch_lines import decode_batch_lines
from batchgen.pipeline.batch_output import OpenAILines
from batchgen.pipeline.config import JobConfig
from batchgen.pipeline.feeder import Feeder
from batchgen.pipeline.id_scan import Position, repeat_key
from batchgen.pipeline.json_columns import with_json_columns
from batchgen.pipeline.metric_columns import job_metric_scorer
from batchgen.pipeline.output import (
    CheckpointWriter,
    CommitContext,
    RestoredRows,
    WorkUnit,
    contiguous_runs,
    load_checkpoints,
)
from batchgen.pipeline.parquet_rows import decode_batch
from batchgen.pipeline.progress import Progress
from batchgen.pipeline.reader import read_rows
from batchgen.pipeline.request_builder import RequestBuilder, RowTask
from batchgen.pipeline.reward_job import completion_column
from batchgen.pipeline.storage import Storage
from batchgen.pipeline.summary import Totals
from batchgen.pipeline.writer import UnitWriter, checkpoint_schema

log = logging.getLogger("batchgen.pipeline")


@dataclass(frozen=True)
class UnitSource:
    """What reading and writing units needs, without the plan: small and picklable (a Ray actor gets one)."""

    job: JobConfig
    output_schema: pa.Schema
    repeats: dict[Position, int]  # occurrence number of each repeated id (input.allow_duplicate_ids)


@dataclass
class UnitsRun:
    totals: Totals  # over the rows this call generated (not those taken from earlier runs' checkpoints)
    generation_seconds: float
    num_rows_reused: int = 0  # output rows taken from earlier runs' checkpoints


def run_units(source: UnitSource, input_storage: Storage, output_storage: Storage, units: list[WorkUnit],
              engine: LLMEngine, commit: CommitContext, *, progress: bool = True,
              on_committed: Callable[[WorkUnit], None] = lambda unit: None) -> UnitsRun:
    """Generate every row of `units` and commit each unit's part (with its record) as it completes."""
    job = source.job
    this_run = Totals()
    openai_lines = OpenAILines(job, commit.config_hash, engine.tokenizer) if job.writes_batch_output else None
    # A batch line whose settings cannot be read writes one error row (its n is unknown).
    n = 1 if job.input.is_batch_file else job.sampling.n
    writer = UnitWriter(output_storage, source.output_schema, [job.input.id_column, *job.output.keep_columns],
                        n, commit, on_rows=this_run.add_table, on_committed=on_committed,
                        openai_lines=openai_lines, is_scoring=job.is_scoring,
                        score_metrics=with_json_columns(job, job_metric_scorer(job)),
                        num_labels=job.num_labels if job.is_reward else None)
    bar = Progress(engine, sum(u.num_rows for u in units), job.name, enabled=progress)
    restored = load_checkpoints(output_storage, units, commit.config_hash)
    if restored.rows:
        log.info("resuming: %d finished request(s) (%d output rows) taken from checkpoints of an earlier run",
                 len(restored.rows), restored.num_output_rows)
    writer.checkpoints = CheckpointWriter(output_storage, checkpoint_schema(source.output_schema), commit.config_hash,
                                          commit.run_id, job.output.checkpoint_seconds, commit.may_commit, restored)

    def on_output(task: RowTask, out: RequestOutput | ScoreOutput) -> None:
        writer.add_output(task, out)
        bar.advance(1)

    def on_error(task: RowTask) -> None:
        writer.add_error(task)
        bar.advance(1)

    tasks = iter_tasks(source, input_storage, units, RequestBuilder(job, engine), writer, restored, bar.advance)
    feeder = Feeder(engine, tasks,
                    window=job.batching.window, sort_by_length=job.batching.sort_by_length,
                    max_in_flight=2 * engine.config.max_num_seqs, max_engine_seqs=engine.config.max_num_seqs,
                    on_output=on_output, on_error=on_error,
                    on_step=lambda: (bar.on_step(feeder.first_add_time), writer.maybe_checkpoint()))
    try:
        feeder.run()
    except BaseException:
        writer.abort()  # unfinished parts leave no temp file behind
        raise
    finally:
        bar.close(feeder.generation_seconds)
    if writer.num_open_units:  # every row was handed back, so every unit must have been written
        raise RuntimeError(f"{writer.num_open_units} unit(s) were not completed")
    return UnitsRun(this_run, feeder.generation_seconds, writer.num_restored_rows)


def input_columns(job: JobConfig) -> list[str]:
    """The input columns a job reads: the id, what makes the prompt, per-row settings, kept columns."""
    scored = [job.input.scored_column] if job.input.scored_column is not None else []
    if job.is_reward:
        scored.append(completion_column(job))
    return list(dict.fromkeys([job.input.id_column, *job.input.prompt_source_columns, *scored,
                               *job.sampling_columns.values(),
                               *([job.input.schema_column] if job.input.schema_column else []),
                               *([job.input.tools_column] if job.input.tools_column else []),
                               *([job.input.lora_column] if job.input.lora_column else []),
                               *job.output.keep_columns]))


def iter_tasks(source: UnitSource, input_storage: Storage, units: list[WorkUnit], builder: RequestBuilder,
               writer: UnitWriter, restored: RestoredRows | None = None,
               on_restored: Callable[[int], None] = lambda num: None) -> Iterator[RowTask]:
    """Every row of `units` as a RowTask, in input order; each unit's id/kept columns go to the writer.
    A row an earlier run's checkpoint holds (`restored`) goes to the writer as it is, not to the engine."""
    job = source.job
    columns = input_columns(job)
    decode = decode_batch_lines if job.input.is_batch_file else decode_batch
    for run in contiguous_runs(units):
        file = run[0].file
        position = run[0].start
        unit_iter = iter(run)
        unit = next(unit_iter)
        writer.open_unit(unit)
        for batch in read_rows(input_storage, file, run[0].start, run[-1].stop, columns):
            while batch.num_rows:
                if position == unit.stop:
                    unit = next(unit_iter)
                    writer.open_unit(unit)
                piece = batch.slice(0, min(batch.num_rows, unit.stop - position))
                batch = batch.slice(piece.num_rows)
                writer.add_source(unit.index, piece)
                first_offset = position - unit.start
                position += piece.num_rows
                for i, row in enumerate(decode(piece, job)):
                    saved = restored.rows.pop((file.display, unit.start + first_offset + i), None) if restored else None
                    if saved is not None:
                        writer.restore(unit.index, first_offset + i, saved)
                        on_restored(1)
                        continue
                    task = builder.build(row, unit.index, first_offset + i)
                    occurrence = source.repeats.get((file.path, unit.start + first_offset + i))
                    if occurrence and task.request_id is not None:
                        task.request_id = repeat_key(task.request_id, occurrence)
                        task.sample_index = occurrence  # task: reward's sample_index
                    yield task


def repeats_of(repeats: dict[Position, int], units: list[WorkUnit]) -> dict[Position, int]:
    """The repeats that fall inside `units` (what a replica needs for the units it is given)."""
    wanted = {(u.file.path, u.start, u.stop) for u in units}
    return {pos: occ for pos, occ in repeats.items()
            if any(path == pos[0] and start <= pos[1] < stop for path, start, stop in wanted)}
