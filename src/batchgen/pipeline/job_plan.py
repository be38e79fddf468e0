"""Everything checked before any weight is loaded: the model exists, the inputs read, the plan of units.

`batchgen validate` stops here and prints the plan; `batchgen run` goes on from here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import fsspec

from batchgen.engine.config import SettingError
from batchgen.engine.kv.capacity import kv_bytes_per_token
from batchgen.engine.loader.source import BUNDLED_ALIASES, ModelSource, bundled_model_path, resolve_model
from batchgen.engine.text.generation_config import FILE_NAME as GENERATION_FILE
from batchgen.engine.text.generation_config import (
    GenerationDefaults,
    parse_generation_config,
    read_generation_defaults,
)
from batchgen.pipeline.config import JobConfig, max_tokens_rule
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.id_scan import Position, scan_ids
from batchgen.pipeline.input_file import InputFile
from batchgen.pipeline.inputs import JobInputs, read_inputs
from batchgen.pipeline.kv_budget import KvBudget, job_kv_budget
from batchgen.pipeline.model_limits import check_model_limits
from batchgen.pipeline.output import (
    FolderState,
    OutputFolder,
    RunIdentity,
    WorkUnit,
    check_output_outside_input,
    plan_units,
)
from batchgen.pipeline.reward_job import check_model_task
from batchgen.pipeline.storage import Storage

log = logging.getLogger("batchgen.pipeline")


@dataclass
class JobPlan:
    job: JobConfig
    config_hash: str
    model_source: ModelSource | None  # None: a remote model (fsspec URI), fetched by the run
    input_storage: Storage
    files: list[InputFile]
    units: list[WorkUnit]
    output: OutputFolder
    state: FolderState
    limit: int | None
    inputs: JobInputs
    repeats: dict[Position, int]  # occurrence number of each repeated id (input.allow_duplicate_ids)

    @property
    def model_location(self) -> str:
        return self.job.model.path if self.model_source is None else self.model_source.display_name

    @property
    def num_rows(self) -> int:
        return sum(u.num_rows for u in self.units)

    @property
    def unit_names(self) -> list[str]:
        return [u.output_name for u in self.units]

    @property
    def is_complete(self) -> bool:
        return self.state.is_complete(self.unit_names)

    @property
    def pending_units(self) -> list[WorkUnit]:
        return [u for u in self.units if u.output_name not in self.state.done_names]

    @property
    def identity(self) -> RunIdentity:
        """What the output folder records of this job (open_run checks and writes it)."""
        return RunIdentity(self.job.name, self.config_hash, self.inputs.fingerprint, self.units)


def check_model(path: str, revision: str | None = None) -> ModelSource | None:
    """Where the model's files are (no weights read); None for a remote model (resolving it would fetch
    its weights). JobError naming model.path (or model.revision) when it is not there."""
    try:
        if path.lower() in BUNDLED_ALIASES and revision is None:
            local = bundled_model_path(path.lower())
            return ModelSource(local.parent, local.name)
        if "://" in path and not path.startswith("file://"):
            fs, fs_path = fsspec.core.url_to_fs(path)
            if not fs.exists(fs_path):
                raise FileNotFoundError(f"{path} does not exist")
            return None
        return resolve_model(path, revision)
    except JobError:
        raise
    except Exception as exc:  # missing file, missing package, unsupported file: all the user's to fix
        key = "model.revision" if revision is not None and "revision" in str(exc) else "model.path"
        raise JobError(f"{key}: {exc}") from None


def apply_generation_config(job: JobConfig, source: ModelSource | None) -> GenerationDefaults:
    """model.generation_config: the file's sampling defaults fill the sampling keys the job file does
    not set (they then enter the config hash like any sampling value); what was filled is recorded on
    the job for _SUCCESS. A remote (URI) model's file is read where it lies. Scoring jobs take none of
    them and beam search only max_new_tokens."""
    setting = job.model.generation_config
    try:
        if source is None and setting == "auto":
            defaults = _remote_generation_defaults(job.model.path)
        else:
            defaults = read_generation_defaults(setting, source)
    except ValueError as exc:
        raise JobError(f"model.generation_config: {exc}") from None
    given = job.sampling.model_fields_set
    # A scoring job samples nothing, and beam search keeps greedy settings (as the server's
    # use_beam_search): the file's sampling values apply to neither, its max_new_tokens to beams only.
    usable = () if job.is_scoring or job.is_reward else ("max_tokens",) if job.sampling.beam_width > 1 else None
    applied = {key: value for key, value in defaults.values.items()
               if key not in given and (usable is None or key in usable)}
    if applied:
        try:
            job.sampling_params(**applied)
        except SettingError as exc:
            raise JobError(f"model.generation_config: {defaults.file} gives sampling.{exc.name} "
                           f"{exc.value!r}, which {exc.rule}; set sampling.{exc.name} in the job") from None
        if "max_tokens" in applied and job.model.max_model_len is not None:
            rule = max_tokens_rule(applied["max_tokens"], job.model.max_model_len)
            if rule:
                raise JobError(f"model.generation_config: {defaults.file} gives sampling.max_tokens "
                               f"{applied['max_tokens']} (max_new_tokens), which {rule}; set sampling.max_tokens "
                               "in the job")
        for key, value in applied.items():
            setattr(job.sampling, key, value)  # now set: a second plan of this job fills nothing more
    # A job planned twice (validate, then run) keeps what its first plan filled in.
    if applied or not job.generation_config_record["applied"]:
        job.record_generation_config(setting, defaults.file, applied)
    return defaults


def _remote_generation_defaults(uri: str) -> GenerationDefaults:
    file_uri = uri.rstrip("/") + "/" + GENERATION_FILE
    fs, fs_path = fsspec.core.url_to_fs(file_uri)
    if uri.endswith(".gguf") or not fs.exists(fs_path):
        return GenerationDefaults("auto")
    return parse_generation_config(fs.cat_file(fs_path).decode("utf-8", "replace"), "auto", file_uri)


def plan_job(job: JobConfig, limit: int | None = None) -> JobPlan:
    """Check the model (and the settings it bounds), the input (footers, schemas, id types, repeated ids)
    and the output folder; plan the units."""
    if limit is not None and limit < 1:
        raise JobError(f"--limit must be >= 1, got {limit}")
    model_source = check_model(job.model.path, job.model.revision)
    apply_generation_config(job, model_source)
    check_model_limits(job)
    job.record_num_labels(check_model_task(job))  # before any weight: the task needs the model's head
    inputs = read_inputs(job)
    output = OutputFolder(Storage(job.output.path, job.output.storage_options))
    check_output_outside_input(output.storage, inputs.storage)
    units = plan_units(inputs.files, job.input.rows_per_unit, limit)
    # A batch file's custom_ids were checked line by line (read_inputs): no repeat got this far.
    repeats = {} if job.input.is_batch_file else scan_ids(
        inputs.storage, units, job.input.id_column, inputs.column_types[job.input.id_column],
        job.input.allow_duplicate_ids)
    job.record_kv_budget(plan_kv_budget(job, inputs.storage, units))
    config_hash = job.config_hash()
    return JobPlan(job, config_hash, model_source, inputs.storage, inputs.files, units, output,
                   output.state(config_hash, inputs.fingerprint, units), limit, inputs, repeats)


def plan_kv_budget(job: JobConfig, storage: Storage, units: list[WorkUnit]) -> KvBudget | None:
    """engine.kv_cache_memory auto on the CPU: the pool sized from the job (pipeline/kv_budget.py); None
    where the engine sizes it itself (a set size, num_kv_blocks, CUDA)."""
    if job.engine.kv_cache_memory != "auto" or getattr(job.engine, "num_kv_blocks", None) is not None:
        return None
    config = job.engine_config()
    if config.torch_device.type != "cpu":
        return None
    from batchgen.pipeline.capacity_plan import read_model

    try:
        cfg = read_model(job.model.path, job.model.revision)[0]
        spec = job.engine.speculative
        draft = 0
        if spec is not None and spec.method == "draft_model" and spec.model is not None:
            draft = kv_bytes_per_token(read_model(spec.model)[0], config.kv_torch_dtype)
    except JobError as exc:  # the engine's own auto rule then sizes the pool; the model load says what is wrong
        log.warning("engine.kv_cache_memory auto: not sized from the job (%s)", exc)
        return None
    max_model_len = min(job.model.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    return job_kv_budget(job, storage, units, max_model_len, kv_bytes_per_token(cfg, config.kv_torch_dtype), draft)


def format_job_plan(plan: JobPlan, max_units_shown: int = 3) -> str:
    """What `batchgen validate` prints: the job, the model, the inputs, the units, the output folder."""
    job = plan.job
    lines = [
        f"job      {job.name}  (config_hash {plan.config_hash[:12]})",
        f"model    {job.model.path}" + ("" if plan.model_location == job.model.path else f" -> {plan.model_location}"),
        f"input    {job.input.path}: {len(plan.files)} file(s), {sum(f.num_rows for f in plan.files):,} rows"
        + (f" (--limit {plan.limit:,})" if plan.limit is not None else ""),
        (f"units    {len(plan.units)} of <= {job.input.rows_per_unit:,} rows; " + (
            "each line's n output rows (OpenAI batch file)" if job.input.is_batch_file
            else f"{plan.num_rows:,} score rows (task: loglikelihood, {job.input.scored_column})" if job.is_scoring
            else f"{plan.num_rows:,} reward rows (task: reward, {job.num_labels} label(s))" if job.is_reward
            else f"{plan.num_rows * job.sampling.n:,} output rows (n={job.sampling.n})")),
    ]
    generation = job.generation_config_record
    if generation["applied"]:
        shown = ", ".join(f"{k}={v}" for k, v in generation["applied"].items())
        lines.append(f"sampling {shown} from {generation['file']} (model.generation_config)")
    if job.metrics:
        shown = ", ".join(f"{name} ({spec.type}" + (f", min {spec.min}" if spec.min is not None else "") + ")"
                          for name, spec in job.metrics.items())
        lines.append(f"metrics  {shown}: metric_<name> columns; below a min, `batchgen run` exits 3")
    if plan.repeats:
        lines.append(f"ids      {len(plan.repeats):,} row(s) repeat an earlier id: each runs as a request of its own "
                     "(input.allow_duplicate_ids)")
    lines.extend(_unit_lines(plan, max_units_shown))
    lines.append(f"output   {job.output.path}: {plan.state.describe(plan.unit_names)}")
    if job.writes_batch_output:
        lines.append("         + output.jsonl and errors.jsonl (OpenAI batch output) before _SUCCESS")
    return "\n".join(lines)


def _unit_lines(plan: JobPlan, max_units_shown: int) -> list[str]:
    """The units in a few lines, however many there are: each one when there are at most
    `max_units_shown`, else the first, a count of those between and the last (a 10M-row input is 1,000
    units; which are done the output line says)."""
    def line(unit: WorkUnit) -> str:
        done = "  (done)" if unit.output_name in plan.state.done_names else ""
        return f"  {unit.output_name}  {unit.file.display} rows {unit.start:,}-{unit.stop - 1:,}{done}"

    units = plan.units
    if len(units) <= max_units_shown:
        return [line(u) for u in units]
    num_files = len({u.file.display for u in units[1:-1]})
    return [line(units[0]), f"  ... {len(units) - 2:,} more unit(s) over {num_files:,} file(s)", line(units[-1])]
