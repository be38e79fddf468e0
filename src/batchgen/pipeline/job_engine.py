"""The job's engine: built from the job's model and engine sections (or one passed in, checked against
them), checked against what the job needs, and what `_SUCCESS` says of it. Local runs, static shards
and Ray replicas all start their engine here."""

from __future__ import annotations

import dataclasses
import logging

from batchgen.engine import EngineConfig, LLMEngine
from batchgen.engine.lora import LoRAError
from batchgen.pipeline.config import JobConfig
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.lora_job import job_adapter, job_lora_requests
from batchgen.pipeline.model_files import needs_chat_template
from batchgen.pipeline.run_record import EngineReport
from batchgen.pipeline.structured_job import check_job_constraint

log = logging.getLogger("batchgen.pipeline")


def start_engine(job: JobConfig, engine: LLMEngine | None) -> LLMEngine:
    """The job's engine (built unless one is passed), checked against what the job needs."""
    engine = engine_for(job, engine)
    check_engine_can_run(job, engine)
    return engine


def engine_for(job: JobConfig, engine: LLMEngine | None) -> LLMEngine:
    """`engine` when its settings are the job's (ValueError naming the ones that differ), else a new
    engine from the job's; one that cannot start is a JobError."""
    wanted = job.engine_config()
    if engine is not None:
        # A pool sized from the job (kv_cache_memory auto) changes no output: any engine's pool will do.
        ignored = ("kv_cache_memory",) if job.engine.kv_cache_memory == "auto" else ()
        differing = _differing_fields(wanted, engine.config, ignored)
        if differing:
            raise ValueError(f"the engine passed in was built with other settings than the job's: {differing}")
        return engine
    try:
        if job.kv_budget is not None and wanted.kv_cache_memory == job.kv_budget.num_bytes:
            log.info("KV cache (engine.kv_cache_memory auto): %s", job.kv_budget.describe())
        return LLMEngine(wanted)
    except LoRAError as exc:  # the job's one adapter, merged at load (model.lora_modules)
        raise JobError(f"model.lora_modules.{job_adapter(job)}: {exc}") from None
    except (ValueError, FileNotFoundError) as exc:  # settings that cannot work (KV cache too small, ...)
        raise JobError(f"cannot start the engine for {job.model.path}: {exc}") from None


# EngineConfig fields that are defaults for requests a job never sends: every job request carries its
# whole SamplingParams (generation_config is applied to the job's sampling section when it is planned)
# and its own sample key (sampling.seed, the row's id), so an engine may differ from the job in these.
_REQUEST_DEFAULT_FIELDS = ("generation_config", "seed")


def _differing_fields(a: EngineConfig, b: EngineConfig, ignored: tuple[str, ...] = ()) -> str:
    names = [f.name for f in dataclasses.fields(a) if f.compare and getattr(a, f.name) != getattr(b, f.name)
             and f.name not in _REQUEST_DEFAULT_FIELDS + ignored]
    return ", ".join(f"{n}: job {getattr(a, n)!r} vs engine {getattr(b, n)!r}" for n in names)


def check_engine_can_run(job: JobConfig, engine: LLMEngine) -> None:
    """JobError when `engine` cannot run this job: its sampling.structured constraint does not compile, the job needs
    a chat template the model lacks, the job's template does not render, or an adapter of model.lora_modules
    cannot run over the model."""
    check_job_constraint(job, engine.compile_grammar)
    for name, request in job_lora_requests(job).items():  # each read once, here: not an error in every row
        try:
            engine.add_lora(request)
        except ValueError as exc:
            raise JobError(f"model.lora_modules.{name}: {exc}") from None
    if needs_chat_template(job) and not engine.tokenizer.has_chat_template:
        raise JobError(f"model.path: {job.model.path} has no chat template; set input.apply_chat_template: "
                       "false and use prompt_column (raw prompts), or give one in input.chat_template")
    if job.input.chat_template is not None or job.input.chat_template_kwargs:
        try:  # once, here: a template that cannot render fails the job, not each of its rows
            engine.tokenizer.check_chat_template(job.input.chat_options)
        except ValueError as exc:
            key = "input.chat_template" if job.input.chat_template is not None else "input.chat_template_kwargs"
            raise JobError(f"{key}: {exc}") from None


def engine_report(engine: LLMEngine, job: JobConfig | None = None) -> EngineReport:
    """What `_SUCCESS` says of the engine that ran: its model, kernels, KV cache (with how the job sized it,
    where it did: `sizing`) and weight format."""
    stats = engine.stats
    kv_cache = dict(stats.get("kv_cache") or {})
    if job is not None and job.kv_budget is not None and engine.config.kv_cache_memory == job.kv_budget.num_bytes:
        kv_cache["sizing"] = job.kv_budget.describe()
    return EngineReport(model=engine.config.model, kernels=stats.get("kernels", {}),
                        kv_cache=kv_cache, weights=stats.get("weights") or {})
