"""The end of a run: `_SUCCESS` written over the whole output (finish_job), and the RunResult a run returns.
A local run and the Ray driver both finish here."""

from __future__ import annotations

from dataclasses import dataclass, field

from batchgen.pipeline.config import JobConfig
from batchgen.pipeline.output import OutputRun
from batchgen.pipeline.run_record import (
    EngineReport,
    GenerationDefaults,
    RunRecord,
    SpeculativeFigures,
    StructuredFigures,
    Workers,
)
from batchgen.pipeline.summary import Totals, read_summary_table


@dataclass
class RunResult:
    """What a finished job run returns: its run record and how much of the work this run did."""

    record: RunRecord  # the _SUCCESS contents
    success_path: str
    num_units_run: int
    num_units_skipped: int
    redone: dict[str, str] = field(default_factory=dict)  # unit files run again -> why they were not trusted
    num_rows_reused: int = 0  # output rows taken from an earlier run's checkpoints (output.checkpoint_seconds)
    num_rows_generated: int = 0  # output rows this run generated (not reused, not in units already done)


def finish_job(job: JobConfig, run: OutputRun, this_run: Totals, generation_seconds: float, *, engine: EngineReport,
               workers: Workers | None = None, speculative: SpeculativeFigures | None = None,
               structured: StructuredFigures | None = None, num_rows_reused: int = 0,
               provenance: dict | None = None) -> RunRecord:
    """The run's `_SUCCESS`, written last (after output.jsonl/errors.jsonl for openai_batch output) while
    the run still holds its folder: counts over the whole output, speed and latency over this run.
    `num_rows_reused`: rows this run took from an earlier run's checkpoints (in its parts, not in `this_run`)."""
    skipped = run.skipped_units
    if num_rows_reused:  # checkpointed rows are in their parts, not in this_run: count every part
        whole, counted = Totals(), run.units
    else:  # this run's rows, and what earlier runs committed (reading every part costs the driver ~40 MB per 1M rows)
        whole, counted = this_run.copy_counts(), skipped
    for unit in counted:
        with run.storage.fs.open(run.storage.join(unit.output_name), "rb") as f:
            whole.add_table(read_summary_table(f), with_latency=False)  # token times: this run's only
    record = RunRecord.of_run(job.name, run.identity.config_hash, whole=whole, this_run=this_run,
                              generation_seconds=generation_seconds, resumed=bool(skipped) or num_rows_reused > 0,
                              engine=engine,
                              generation_config=GenerationDefaults.from_dict(job.generation_config_record),
                              workers=workers, speculative=speculative, structured=structured,
                              provenance=provenance)
    run.finish(record, write_batch_outputs=job.writes_batch_output)  # the .jsonl from every committed part
    return record
