"""Run a multi-stage job: each stage in order, each a job of its own in `<output.path>/<stage>/`.

A stage already complete with its identity is skipped without loading its model, so a crash in stage 3
recomputes nothing of stages 1-2. A stage whose folder holds this very stage's output made with other
settings (its own, or an earlier stage's: both are in its identity) is made again; a folder holding
anything else is refused as for any job. Model stages load their engine only when they have work; an
engine is kept for the next stage when that stage's model and engine settings are the same, and released
(its memory freed) before a different one loads.
"""

from __future__ import annotations

import gc
import json
import logging
from dataclasses import dataclass

from batchgen.engine import LLMEngine
from batchgen.pipeline.job import run_job
from batchgen.pipeline.job_engine import engine_for
from batchgen.pipeline.job_plan import plan_job
from batchgen.pipeline.output import MANIFEST_NAME, SUCCESS_NAME, FolderState
from batchgen.pipeline.run_record import RunRecord
from batchgen.pipeline.stages.select_run import run_select_stage, select_state, stage_job_name
from batchgen.pipeline.stages.spec import Stage, StagedJob
from batchgen.pipeline.storage import Storage

log = logging.getLogger("batchgen.pipeline")


@dataclass
class StageResult:
    """What one stage's run did: its record (`_SUCCESS`), whether it ran, whether it replaced old output."""

    stage: Stage
    record: RunRecord
    success_path: str
    num_units_run: int
    num_units_skipped: int
    is_replaced: bool = False  # its folder held this stage's output of other settings, made again


class EngineHolder:
    """The engine the stages share: kept while the settings match, released before another loads."""

    def __init__(self, engine: LLMEngine | None = None):
        self.engine = engine
        self.is_ours = False  # an engine passed in is the caller's to shut down
        self.num_loaded = 0  # engines this holder built

    def for_job(self, job) -> LLMEngine:
        if self.engine is not None:
            try:
                return engine_for(job, self.engine)
            except ValueError:  # other settings: this one goes before the next one loads
                self.release()
        self.engine = engine_for(job, None)
        self.is_ours = True
        self.num_loaded += 1
        return self.engine

    def release(self) -> None:
        """Drop the engine (shut down if this holder built it) and free its memory."""
        engine, self.engine = self.engine, None
        if engine is not None and self.is_ours:
            engine.shutdown()
        del engine
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:  # pragma: no cover - torch is a dependency
            pass


def run_staged_job(staged: StagedJob, *, overwrite: bool = False, progress: bool = True,
                   engine: LLMEngine | None = None) -> list[StageResult]:
    """Run every stage in order (each resumes on its own). `engine`: one already built that stages with
    its settings use (tests, notebooks)."""
    holder = EngineHolder(engine)
    results = []
    write_stages_manifest(staged)
    try:
        for stage in staged.stages:
            results.append(_run_stage(stage, staged, holder, overwrite, progress))
    finally:
        holder.release()
    return results


def _run_stage(stage: Stage, staged: StagedJob, holder: EngineHolder, overwrite: bool,
               progress: bool) -> StageResult:
    storage = Storage(stage.output_path, staged.storage_options)
    if stage.is_select:
        state, _ = select_state(stage, staged)
        is_replaced = not overwrite and is_stale(state, storage, stage_job_name(staged, stage))
        _log_replace(stage, is_replaced)
        record, ran = run_select_stage(stage, staged, overwrite=overwrite or is_replaced)
        return StageResult(stage, record, storage.join(SUCCESS_NAME), int(ran), int(not ran), is_replaced)
    job = stage.job
    limit = staged.limit if stage.upstream is None else None
    plan = plan_job(job, limit)
    is_replaced = not overwrite and is_stale(plan.state, storage, job.name)
    _log_replace(stage, is_replaced)
    engine = None
    if (overwrite or is_replaced or not plan.is_complete) and job.cluster.backend != "ray":
        engine = holder.for_job(job)
    result = run_job(job, engine=engine, limit=limit, overwrite=overwrite or is_replaced, progress=progress)
    return StageResult(stage, result.record, result.success_path, result.num_units_run, result.num_units_skipped,
                       is_replaced)


STAGES_NAME = "_stages.json"


def write_stages_manifest(staged: StagedJob) -> None:
    """`<output.path>/_stages.json`: the stages in run order, what each reads and its identity (the report
    reads it to show the stages in order)."""
    stages = [{"name": s.name, "task": s.task, "reads": {"stage": s.upstream} if s.upstream else {"path": s.input_path or s.job.input.path},
               "rule": s.select.rule if s.select else None, "config_hash": s.identity,
               "folder": s.output_path.rstrip("/").rsplit("/", 1)[-1]} for s in staged.stages]
    Storage(staged.output_path, staged.storage_options).write_text_atomic(
        STAGES_NAME, json.dumps({"job": staged.name, "stages": stages}, indent=1) + "\n")


def is_stale(state: FolderState, storage: Storage, job_name: str) -> bool:
    """The folder holds this very stage's output (its manifest names the stage) made with other settings
    or from another input: it is made again. Anything else refused stays refused."""
    if state.refusal is None:
        return False
    try:
        manifest = json.loads(storage.read_text(MANIFEST_NAME))
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("job") == job_name


def _log_replace(stage: Stage, is_replaced: bool) -> None:
    if is_replaced:
        log.info("stage %s: its settings or an earlier stage's output changed: its output is made again",
                 stage.name)
