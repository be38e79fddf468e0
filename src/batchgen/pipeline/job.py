"""run_job: plan, check, start the engine, stream rows through it into unit files, write _SUCCESS."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

from batchgen.engine import EngineConfig, LLMEngine
from batchgen.pipeline.config import JobConfig
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.job_plan import JobPlan, plan_job
from batchgen.pipeline.model_files import needs_chat_template
from batchgen.pipeline.output import (
    SUCCESS_NAME,
    OutputRun,
    describe_redo,
    open_run,
    raise_if_locked,
    raise_if_refused,
)
from batchgen.pipeline.structured_job import check_job_constraint
from batchgen.pipeline.run_record import (
    EngineReport,
    GenerationDefaults,
    RunRecord,
    SpeculativeFigures,
    StructuredFigures,
    Workers,
)
from batchgen.pipeline.summary import Totals, read_summary_table, speculative_summary, structured_summary
from batchgen.pipeline.unit_loop import UnitSource, run_units

log = logging.getLogger("batchgen.pipeline")


@dataclass
class RunResult:
    record: RunRecord  # the _SUCCESS contents
    success_path: str
    num_units_run: int
    num_units_skipped: int
    redone: dict[str, str] = field(default_factory=dict)  # unit files run again -> why they were not trusted


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


def start_engine(job: JobConfig, engine: LLMEngine | None) -> LLMEngine:
    """The job's engine (built unless one is passed), checked against what the job needs."""
    engine = engine_for(job, engine)
    check_engine_can_run(job, engine)
    return engine


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

    source = UnitSource(job, plan.inputs.output_schema(job), plan.repeats)
    spec_before = engine.stats.get("speculative")  # None: speculation off (or an engine without it)
    structured_before = engine.stats.get("structured")
    ran = run_units(source, plan.input_storage, run.storage, pending, engine, run.commit_context(),
                    progress=progress)
    after = engine.stats
    record = finish_job(job, run, ran.totals, ran.generation_seconds, engine=engine_reports(engine),
                        speculative=speculative_summary(spec_before, after.get("speculative")),
                        structured=structured_summary(structured_before, after.get("structured")))
    return RunResult(record, success_path, len(pending), len(skipped), dict(run.redo))


def engine_reports(engine: LLMEngine) -> EngineReport:
    """What `_SUCCESS` says of the engine that ran: its model, kernels, KV cache and weight format."""
    stats = engine.stats
    return EngineReport(model=engine.config.model, kernels=stats.get("kernels", {}),
                        kv_cache=stats.get("kv_cache") or {}, weights=stats.get("weights") or {})


def finish_job(job: JobConfig, run: OutputRun, this_run: Totals, generation_seconds: float, *, engine: EngineReport,
               workers: Workers | None = None, speculative: SpeculativeFigures | None = None,
               structured: StructuredFigures | None = None) -> RunRecord:
    """The run's `_SUCCESS`, written last (after output.jsonl/errors.jsonl for openai_batch output) while
    the run still holds its folder: counts over the whole output, speed and latency over this run."""
    whole = dataclasses.replace(this_run, ttft_s=[], tpot_s=[])  # latency figures: this run only
    skipped = run.skipped_units
    for unit in skipped:  # counts cover the whole output, also what an earlier run wrote
        with run.storage.fs.open(run.storage.join(unit.output_name), "rb") as f:
            whole.add_table(read_summary_table(f))
    record = RunRecord.of_run(job.name, run.identity.config_hash, whole=whole, this_run=this_run,
                              generation_seconds=generation_seconds, resumed=bool(skipped), engine=engine,
                              generation_config=GenerationDefaults.from_dict(job.generation_config_record),
                              workers=workers, speculative=speculative, structured=structured)
    run.finish(record, write_batch_outputs=job.writes_batch_output)  # the .jsonl from every committed part
    return record


def engine_for(job: JobConfig, engine: LLMEngine | None) -> LLMEngine:
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


# EngineConfig fields that are defaults for requests a job never sends: every job request carries its
# whole SamplingParams (generation_config is applied to the job's sampling section when it is planned)
# and its own sample key (sampling.seed, the row's id), so an engine may differ from the job in these.
_REQUEST_DEFAULT_FIELDS = ("generation_config", "seed")


def _differing_fields(a: EngineConfig, b: EngineConfig) -> str:
    names = [f.name for f in dataclasses.fields(a) if f.compare and getattr(a, f.name) != getattr(b, f.name)
             and f.name not in _REQUEST_DEFAULT_FIELDS]
    return ", ".join(f"{n}: job {getattr(a, n)!r} vs engine {getattr(b, n)!r}" for n in names)


def check_engine_can_run(job: JobConfig, engine: LLMEngine) -> None:
    check_job_constraint(job, engine.compile_grammar)
    if needs_chat_template(job) and not engine.tokenizer.has_chat_template:
        raise JobError(f"model.path: {job.model.path} has no chat template; set input.apply_chat_template: "
                       "false and use prompt_column (raw prompts), or give one in input.chat_template")
    if job.input.chat_template is not None or job.input.chat_template_kwargs:
        try:  # once, here: a template that cannot render fails the job, not each of its rows
            engine.tokenizer.check_chat_template(job.input.chat_options)
        except ValueError as exc:
            key = "input.chat_template" if job.input.chat_template is not None else "input.chat_template_kwargs"
            raise JobError(f"{key}: {exc}") from None
