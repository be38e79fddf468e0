"""`batchgen validate` of a multi-stage job: the graph (read already by spec.py) and each stage, before any
weight loads.

A stage that reads a path, or an earlier stage whose output is complete and current (made with this
job's settings), is planned in full (as a single job: model files, input schemas, units, its folder's
state). A stage whose earlier stage has not run yet, or will run again, is checked as far as it can be
without that output: its model's files, its structured-output constraint, and the columns it reads
against the columns the earlier stage will write (spec.py).
"""

from __future__ import annotations

from batchgen.pipeline.job_plan import apply_generation_config, check_model, format_job_plan, plan_job
from batchgen.pipeline.model_files import check_model_files, needs_chat_template
from batchgen.pipeline.model_limits import check_model_limits
from batchgen.pipeline.output import SUCCESS_NAME
from batchgen.pipeline.stages.run import is_stale
from batchgen.pipeline.stages.select_run import select_state
from batchgen.pipeline.stages.spec import Stage, StagedJob
from batchgen.pipeline.stages.text import describe_stage
from batchgen.pipeline.storage import Storage
from batchgen.pipeline.structured_job import check_job_constraint_before_load

STALE = "made again: it holds this stage's output of other settings (its own or an earlier stage's)"


def validate_staged_job(staged: StagedJob) -> tuple[list[str], bool]:
    """What validate prints for each stage, and whether a folder would be refused. JobError (naming the
    stage) for anything wrong."""
    lines = [f"job      {staged.name}: {len(staged.stages)} stage(s) -> {staged.output_path}/<stage>/"]
    is_refused = False
    current: set[str] = set()  # the stages whose complete output a run keeps
    for stage in staged.stages:
        lines.append(f"\n== {describe_stage(stage)}")
        has_input = stage.upstream is None or stage.upstream in current
        try:
            stage_lines, refused = _validate_stage(stage, staged, has_input)
        except Exception as exc:
            exc.args = (f"stage {stage.name!r}: {exc.args[0] if exc.args else exc}", *exc.args[1:])
            raise
        lines += stage_lines
        is_refused = is_refused or refused
        if has_input and not refused and _is_complete(stage, staged) and not any(line.endswith(STALE) for line in stage_lines):
            current.add(stage.name)
    return lines, is_refused


def _is_complete(stage: Stage, staged: StagedJob) -> bool:
    storage = Storage(stage.output_path, staged.storage_options)
    return storage.fs.exists(storage.join(SUCCESS_NAME))


def _validate_stage(stage: Stage, staged: StagedJob, has_input: bool) -> tuple[list[str], bool]:
    upstream = staged.by_name.get(stage.upstream) if stage.upstream else None
    if stage.is_select:
        if not has_input:
            return [f"columns  {', '.join(stage.select.columns_read())} checked against stage {upstream.name}'s "
                    "output; it runs after that stage (not written yet, or to be made again)"], False
        state, identity = select_state(stage, staged)
        if is_stale(state, Storage(stage.output_path, staged.storage_options), identity.job_name):
            return [f"output   {stage.output_path}: {STALE}"], False
        return [f"output   {stage.output_path}: {state.describe(identity.unit_names)}"], bool(state.refusal)
    job = stage.job
    if has_input:
        plan = plan_job(job, staged.limit if upstream is None else None)
        lines = format_job_plan(plan).splitlines()
        source = plan.model_source
        refused = bool(plan.state.refusal)
        if refused and is_stale(plan.state, plan.output.storage, job.name):
            at = max(i for i, line in enumerate(lines) if line.startswith("output   "))
            lines[at], refused = f"output   {job.output.path}: {STALE}", False
    else:
        source = check_model(job.model.path, job.model.revision)
        apply_generation_config(job, source)
        check_model_limits(job)
        lines = [f"model    {job.model.path}",
                 f"input    stage {upstream.name}'s output (not written yet, or to be made again): columns "
                 f"{', '.join(job.input.prompt_source_columns)} checked against what it writes"]
        refused = False
    check_job_constraint_before_load(job)
    if source is not None:
        files = check_model_files(source, needs_chat_template(job))
        lines.append(f"files    tokenizer ({files.num_tokens:,} tokens), "
                     + ("chat template: renders" if files.has_chat_template else "no chat template"))
    return lines, refused
