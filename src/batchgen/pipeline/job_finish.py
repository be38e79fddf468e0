"""The end of a run: `_SUCCESS` written over the whole output (finish_job), and the RunResult a run returns.
A local run and the Ray driver both finish here."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from batchgen.pipeline.config import JobConfig
from batchgen.pipeline.output import OutputRun
from batchgen.pipeline.summary import Totals, read_summary_table, success_record


@dataclass
class RunResult:
    record: dict  # the _SUCCESS contents
    success_path: str
    num_units_run: int
    num_units_skipped: int
    redone: dict[str, str] = field(default_factory=dict)  # unit files run again -> why they were not trusted


def finish_job(job: JobConfig, run: OutputRun, this_run: Totals, generation_seconds: float, *, kernels: dict,
               kv_cache: dict | None = None, weights: dict | None = None, workers: dict | None = None,
               speculative: dict | None = None, model: str | None = None, structured: dict | None = None) -> dict:
    """The run's `_SUCCESS`, written last (after output.jsonl/errors.jsonl for openai_batch output) while
    the run still holds its folder: counts over the whole output, speed and latency over this run."""
    whole = dataclasses.replace(this_run, ttft_s=[], tpot_s=[])  # latency figures: this run only
    skipped = run.skipped_units
    for unit in skipped:  # counts cover the whole output, also what an earlier run wrote
        with run.storage.fs.open(run.storage.join(unit.output_name), "rb") as f:
            whole.add_table(read_summary_table(f))
    record = success_record(job.name, run.identity.config_hash, whole, this_run, generation_seconds,
                            resumed=bool(skipped), kernels=kernels, kv_cache=kv_cache, weights=weights,
                            workers=workers, speculative=speculative, model=model, structured=structured,
                            generation_config=job.generation_config_record)
    run.finish(record, write_batch_outputs=job.writes_batch_output)  # the .jsonl from every committed part
    return record
