"""run_job: plan, check, start the engine, stream rows through it into unit files, write _SUCCESS."""

from __future__ import annotations

import logging

from batchgen.engine import LLMEngine
from batchgen.pipeline.config import JobConfig
from batchgen.pipeline.job_engine import engine_report, start_engine
from batchgen.pipeline.job_finish import RunResult, finish_job
from batchgen.pipeline.job_plan import JobPlan, plan_job
from batchgen.pipeline.output import (
    SUCCESS_NAME,
    OutputRun,
    describe_redo,
    open_run,
    raise_if_locked,
    raise_if_refused,
)
from batchgen.pipeline.provenance import plan_provenance, with_provenance
from batchgen.pipeline.summary import speculative_summary, structured_summary
from batchgen.pipeline.unit_loop import UnitSource, run_units

log = logging.getLogger("batchgen.pipeline")


def run_job(job: JobConfig, *, engine: LLMEngine | None = None, limit: int | None = None,
            overwrite: bool = False, progress: bool = True) -> RunResult:
    """Run a job to completion (or resume it). Raises JobError for a bad job before any generation.

    The run holds its output folder's lock from before it touches the folder until it returns; a
    second run on the same folder raises LockHeld (a JobError) naming this one. The engine starts
    before the folder is touched: an engine that cannot start (a model file the loader refuses, a KV
    cache too small) leaves the folder as it was, with no manifest that would make the fixed job look
    like "a different job config".
    `engine`: an already-built engine whose config equals the job's (tests and notebooks reuse one);
    None builds one from the job's model and engine sections.
    """
    if job.cluster.backend == "ray":
        from batchgen.pipeline.ray_driver import run_on_ray

        if engine is not None:
            raise ValueError("cluster.backend: ray starts its engines in the replicas; do not pass one")
        return run_on_ray(job, limit=limit, overwrite=overwrite, progress=progress)
    plan = plan_job(job, limit)
    if not overwrite:
        raise_if_refused(plan.state)  # before the lock: nothing is written into a folder that is not ours
    if overwrite or not plan.is_complete:
        raise_if_locked(plan.output.storage)  # a held folder is refused before minutes of model loading
        engine = start_engine(job, engine)
    with open_run(plan.output.storage, plan.identity, overwrite=overwrite) as run:
        return _run_held(plan, run, engine, progress)


def _run_held(plan: JobPlan, run: OutputRun, engine: LLMEngine | None, progress: bool) -> RunResult:
    job = plan.job
    plan.state = run.state
    success_path = run.storage.join(SUCCESS_NAME)
    if run.is_complete:
        log.info("%s is complete (_SUCCESS present); nothing to do", job.output.path)
        return RunResult(run.read_success(), success_path, 0, len(plan.units))
    pending, skipped = run.pending_units, run.skipped_units
    if run.redo:
        log.warning("%s", describe_redo(run.redo))
    if skipped:
        log.info("resuming: skipping %d finished unit(s) (%s); %d to run", len(skipped),
                 ", ".join(u.output_name for u in skipped), len(pending))
    engine = start_engine(job, engine)  # started already, unless the plan found the folder complete

    provenance = plan_provenance(plan, engine)  # in every part's metadata and in _SUCCESS
    source = UnitSource(job, with_provenance(plan.inputs.output_schema(job), provenance), plan.repeats)
    spec_before = engine.stats.get("speculative")  # None: speculation off (or an engine without it)
    structured_before = engine.stats.get("structured")
    ran = run_units(source, plan.input_storage, run.storage, pending, engine, run.commit_context(),
                    progress=progress)
    after = engine.stats
    record = finish_job(job, run, ran.totals, ran.generation_seconds, engine=engine_report(engine, job),
                        speculative=speculative_summary(spec_before, after.get("speculative")),
                        structured=structured_summary(structured_before, after.get("structured")),
                        num_rows_reused=ran.num_rows_reused, provenance=provenance)
    return RunResult(record, success_path, len(pending), len(skipped), dict(run.redo), ran.num_rows_reused,
                     ran.totals.num_rows)
