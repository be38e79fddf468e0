"""A multi-stage job file: `stages:` read into a checked graph of stages, each a job of its own.

    name: dpo
    output: {path: out/dpo/}              # one folder per stage: out/dpo/<stage name>/
    model: {path: smollm2-135m-instruct}  # top-level model, engine, sampling, batching, cluster:
    sampling: {max_tokens: 128}           #   defaults every model stage's own keys override
    stages:
      - {name: gen, input: {path: prompts.parquet, messages_column: messages}, sampling: {n: 4}}
      - {name: rm, task: reward, model: {path: rm/}, input: {stage: gen}}
      - {name: pairs, task: select, input: {stage: rm}, select: {rule: dpo_pairs}}

What a stage reads from an earlier one: the earlier stage's committed output folder, with `id` as its
id column (repeated: one row per sample), its prompt column carried on, and every column of it except the
run statistics (token ids, token counts, latencies) kept in this stage's output; a kept column whose name
this stage writes itself is kept as `<earlier stage>_<column>`: a judge (a generate stage) writes its own
`completion`, so the judged sample is `gen_completion`; a reward stage writes `reward`, `sample_index`,
`finish_reason` and `error` but no `completion`, so the scored sample stays `completion` there.
A stage's identity (its config hash) includes the identities of the stages it reads.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from batchgen.metrics import metric_column
from batchgen.pipeline.config import JobConfig, format_validation_error, validate_job
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.schema import RESERVED_NAMES, REWARD_NAMES, SCORE_FIELDS, generated_fields
from batchgen.pipeline.stages.columns import judge_columns
from batchgen.pipeline.stages.select_config import SelectSection

DEFAULT_SECTIONS = ("model", "engine", "sampling", "batching", "cluster")
TOP_LEVEL_KEYS = ("name", "output", "stages", *DEFAULT_SECTIONS)
SELECT_KEYS = ("name", "task", "input", "select")
SELECT_TASK = "select"
REWARD_TASK = "reward"
# Columns of a model stage's output that describe how it ran, not what it made: not carried to later stages.
RUN_STAT_COLUMNS = frozenset({
    "completion_token_ids", "prompt_tokens", "cached_tokens", "completion_tokens", "cumulative_logprob",
    "token_logprobs", "top_logprobs", "queue_s", "ttft_s", "tpot_s", "e2e_s", "num_accepted_tokens", "openai_line",
    "continuation_token_ids", "continuation_token_logprobs"})
# The columns a model task writes besides `id` and the kept ones, by task (a reward stage's are
# schema.REWARD_FIELDS less its run statistics).
TASK_COLUMNS: dict[str, tuple[str, ...]] = {
    "generate": tuple(f.name for f in generated_fields(True)),
    "loglikelihood": tuple(f.name for f in SCORE_FIELDS),
    "reward": ("sample_index", "reward", "finish_reason", "error"),
}


@dataclass
class Stage:
    """One stage: a model job (generate, loglikelihood, reward, ...) or a select over an earlier stage."""

    name: str
    task: str
    upstream: str | None  # the stage it reads; None: it reads input.path
    output_path: str
    job: JobConfig | None = None  # a model stage's job
    select: SelectSection | None = None  # a select stage's rule
    input_path: str | None = None  # a select stage's input folder or files
    prompt_column: str | None = None  # the prompt column it carries on (None: unknown)
    is_messages: bool = False  # ... chat messages (else raw text)
    system_prompt: str | None = None  # the first stage's input.system_prompt, sent with that prompt column
    prompt_column_read: str | None = None  # a select stage: the prompt column it reads
    is_messages_read: bool = False
    system_prompt_read: str | None = None  # a select stage: the system prompt its prompts were sent with
    columns: list[str] | None = None  # the columns of its output (None: unknown before it runs)
    identity: str = ""  # its config hash, over its settings and the identities of the stages it reads

    @property
    def is_select(self) -> bool:
        return self.task == SELECT_TASK


@dataclass
class StagedJob:
    """A multi-stage job: its stages in the order they run (each after the stages it reads)."""

    name: str
    output_path: str
    storage_options: dict[str, Any]
    stages: list[Stage]
    source: str
    limit: int | None = None
    by_name: dict[str, Stage] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.by_name = {s.name: s for s in self.stages}


def is_staged(raw: dict) -> bool:
    """A job mapping with a `stages:` list (else a single-stage job, read as before)."""
    return isinstance(raw, dict) and "stages" in raw


def read_staged_job(raw: dict, base_dir: Path, source: str, limit: int | None = None) -> StagedJob:
    """Check the stage graph and every stage's settings (JobError naming the stage and key), before any
    file is read or model loaded; resolve paths against `base_dir`."""
    unknown = [k for k in raw if k not in TOP_LEVEL_KEYS]
    if unknown:
        raise JobError(f"{source}: invalid job\n  {unknown[0]}: not a key of a multi-stage job's top level (set it "
                       f"in each stage); allowed keys here: {', '.join(TOP_LEVEL_KEYS)}")
    name = raw.get("name")
    stages_raw = raw["stages"]
    if not isinstance(stages_raw, list) or not stages_raw or not all(isinstance(s, dict) for s in stages_raw):
        raise JobError(f"{source}: invalid job\n  stages: a non-empty list of stages (mappings with name, task, "
                       "input, ...)")
    output = dict(raw.get("output") or {})
    extra = [k for k in output if k not in ("path", "storage_options")]
    if extra:
        raise JobError(f"{source}: invalid job\n  output.{extra[0]}: set it in a stage's own output section; a "
                       "multi-stage job's output takes path and storage_options")
    out_path = _resolve(output.get("path") or f"out/{name}", base_dir).rstrip("/")
    order = _stage_order(stages_raw, source)
    stages: dict[str, Stage] = {}
    for index in order:
        stage_raw = stages_raw[index]
        where = f"{source}: stage {stage_raw['name']!r}"
        stage = _read_stage(raw, stage_raw, stages, base_dir, out_path, output.get("storage_options") or {},
                            where)
        stages[stage.name] = stage
    return StagedJob(name, out_path, output.get("storage_options") or {}, list(stages.values()), source, limit)


def _stage_order(stages_raw: list[dict], source: str) -> list[int]:
    """The stages' indexes in run order (each after the stage it reads; file order otherwise); JobError
    for a missing or repeated name, an unknown stage and a cycle."""
    names: dict[str, int] = {}
    for i, stage in enumerate(stages_raw):
        name = stage.get("name")
        if not isinstance(name, str) or not name or name in (".", "..") or any(c in name for c in "/\\\0"):
            raise JobError(f"{source}: invalid job\n  stages[{i}].name: each stage needs a name that is one folder "
                           f"name (no '/', not '.' or '..'); got {name!r}")
        if name in names:
            raise JobError(f"{source}: invalid job\n  stages[{i}].name: {name!r} names two stages "
                           f"(stages[{names[name]}] too); stage names must differ")
        names[name] = i
    reads: dict[str, str | None] = {}
    for stage in stages_raw:
        inp = stage.get("input")
        upstream = inp.get("stage") if isinstance(inp, dict) else None
        if upstream is not None and upstream not in names:
            raise JobError(f"{source}: invalid job\n  stage {stage['name']!r}: input.stage: no stage named "
                           f"{upstream!r} (stages: {', '.join(names)})")
        reads[stage["name"]] = upstream
    for name in names:  # each stage reads at most one: following the reads finds any cycle
        path, current = [name], reads[name]
        while current is not None:
            if current in path:
                cycle = " -> ".join(path[path.index(current):] + [current])
                raise JobError(f"{source}: invalid job\n  stages: the stages read each other in a cycle: {cycle}")
            path.append(current)
            current = reads[current]
    order: list[int] = []
    placed: set[str] = set()
    while len(order) < len(stages_raw):
        for i, stage in enumerate(stages_raw):
            if stage["name"] not in placed and (reads[stage["name"]] is None or reads[stage["name"]] in placed):
                order.append(i)
                placed.add(stage["name"])
                break
    return order


def _read_stage(top: dict, raw: dict, done: dict[str, Stage], base_dir: Path, out_path: str,
                storage_options: dict, where: str) -> Stage:
    name = raw["name"]
    task = raw.get("task", "generate")
    inp = raw.get("input")
    if not isinstance(inp, dict):
        raise JobError(f"{where}: input: required: {{path: ...}} or {{stage: <an earlier stage's name>}}")
    upstream = done[inp["stage"]] if inp.get("stage") is not None else None
    if upstream is not None and "path" in inp:
        raise JobError(f"{where}: input: set path or stage, not both")
    output_path = f"{out_path}/{name}/"
    if task == SELECT_TASK:
        stage = _select_stage(raw, upstream, base_dir, output_path, where)
    else:
        stage = _model_stage(top, raw, upstream, base_dir, output_path, storage_options, where)
    upstream_ids = {upstream.name: upstream.identity} if upstream is not None else {}
    if stage.job is not None:
        stage.job._upstream_identities = upstream_ids
        stage.identity = stage.job.config_hash()
    else:
        payload = {"select": stage.select.model_dump(), "upstream": upstream_ids, "input": stage.input_path}
        stage.identity = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
    return stage


def _select_stage(raw: dict, upstream: Stage | None, base_dir: Path, output_path: str, where: str) -> Stage:
    unknown = [k for k in raw if k not in SELECT_KEYS]
    if unknown:
        raise JobError(f"{where}: {unknown[0]}: not a key of a select stage (it loads no model); allowed keys: "
                       f"{', '.join(SELECT_KEYS)}")
    try:
        section = SelectSection.model_validate(raw.get("select") or {})
    except ValidationError as exc:
        lines = format_validation_error(exc).replace("  ", "  select.", 1).replace("\n  ", "\n  select.")
        raise JobError(f"{where}: invalid select\n{lines}") from None
    inp = raw["input"]
    extra = [k for k in inp if k not in ("stage", "path")]
    if extra:
        raise JobError(f"{where}: input.{extra[0]}: a select stage's input takes stage or path only")
    input_path = upstream.output_path if upstream is not None else _resolve(str(inp["path"]), base_dir)
    stage = Stage(raw["name"], SELECT_TASK, upstream.name if upstream else None, output_path, select=section,
                  input_path=input_path)
    if section.messages_column is not None:
        stage_prompt = (section.messages_column, True)
    elif section.prompt_column is not None:
        stage_prompt = (section.prompt_column, False)
    elif upstream is not None and upstream.prompt_column is not None:
        stage_prompt = (upstream.prompt_column, upstream.is_messages)
    else:
        stage_prompt = (None, False)
    stage.prompt_column, stage.is_messages = stage_prompt
    stage.prompt_column_read, stage.is_messages_read = stage_prompt
    if upstream is not None and stage_prompt[0] == upstream.prompt_column:
        stage.system_prompt_read = upstream.system_prompt  # the rule writes it into the prompts it outputs
    if upstream is not None and upstream.columns is not None:
        _check_columns_read(section, stage.prompt_column, upstream, where)
    stage.columns = _select_columns(section, upstream)
    if section.rule == "dpo_pairs":
        stage.prompt_column = "prompt"
        stage.is_messages = stage.is_messages_read or stage.system_prompt_read is not None
    elif section.rule == "best_of_n":
        stage.prompt_column, stage.is_messages = "messages", True
    else:  # filter: the rows as they were, prompts and all
        stage.system_prompt = stage.system_prompt_read
    return stage


def _check_columns_read(section: SelectSection, prompt_column: str | None, upstream: Stage, where: str) -> None:
    """Every column the rule reads is one the earlier stage writes (JobError naming the key)."""
    wanted = section.columns_read()
    if section.rule != "filter":
        if prompt_column is None:
            raise JobError(f"{where}: select.prompt_column: stage {upstream.name!r} carries no prompt column; set "
                           "select.prompt_column or select.messages_column")
        wanted.setdefault(prompt_column, "the prompt column carried from the earlier stages")
    for column, key in wanted.items():
        if column not in upstream.columns:
            raise JobError(f"{where}: {key}: column {column!r} is not in the output of stage {upstream.name!r} "
                           f"(its columns: {', '.join(upstream.columns)})")


def _select_columns(section: SelectSection, upstream: Stage | None) -> list[str] | None:
    keep = [c for c in section.keep_columns]
    if section.rule == "dpo_pairs":
        return ["id", "prompt", "chosen", "rejected", "chosen_score", "rejected_score", *keep]
    if section.rule == "best_of_n":
        return ["id", "messages", section.score_column, *keep]
    return None if upstream is None or upstream.columns is None else list(upstream.columns)


def _model_stage(top: dict, raw: dict, upstream: Stage | None, base_dir: Path, output_path: str,
                 storage_options: dict, where: str) -> Stage:
    merged: dict[str, Any] = {k: v for k, v in raw.items() if k not in DEFAULT_SECTIONS}
    for key in DEFAULT_SECTIONS:  # a stage's own keys over the job's defaults, key by key
        if key in top or key in raw:
            merged[key] = {**(top.get(key) or {}), **(raw.get(key) or {})}
    merged["name"] = f"{top.get('name')}/{raw['name']}"
    inp = {k: v for k, v in raw["input"].items() if k != "stage"}
    out = dict(raw.get("output") or {})
    for key in ("path", "storage_options", "format"):
        if key in out:
            raise JobError(f"{where}: output.{key}: a stage's output is <job output.path>/<stage name>/ (set "
                           "output.path and storage_options at the job's top level)")
    out["path"], out["storage_options"] = output_path, storage_options
    keep = list(out.get("keep_columns") or [])
    renames = dict(out.get("rename_columns") or {})
    # Only the columns this stage writes itself push a carried column aside: a reward stage writes no
    # `completion`, so the sample it scores stays `completion` for the stage after it.
    task = raw.get("task", "generate")
    own = set(REWARD_NAMES if task == REWARD_TASK else RESERVED_NAMES) | set(TASK_COLUMNS.get(task, ())) | {
        metric_column(m) for m in (merged.get("metrics") or {})} | set(judge_columns(merged, base_dir))
    if upstream is not None:
        inp["path"] = upstream.output_path
        inp.setdefault("id_column", "id")
        inp.setdefault("allow_duplicate_ids", True)
        inp.setdefault("storage_options", storage_options)
        gives_prompt = any(k in inp for k in ("prompt_column", "messages_column", "prompt_template"))
        if not gives_prompt and upstream.prompt_column is not None:
            inp["messages_column" if upstream.is_messages else "prompt_column"] = upstream.prompt_column
        carried = [c for c in (upstream.columns or []) if c != "id" and c not in RUN_STAT_COLUMNS]
        for column in carried:
            if column not in keep:
                keep.append(column)
            if column in own and column not in renames:
                renames[column] = f"{upstream.name}_{column}"
    out["keep_columns"], out["rename_columns"] = keep, renames
    merged["input"], merged["output"] = inp, out
    try:
        job = validate_job(merged, base_dir, source=where)
    except JobError as exc:
        raise JobError(str(exc).replace(f"{where}: invalid job", f"{where}: invalid stage", 1)) from None
    if upstream is not None and upstream.columns is not None:
        _check_stage_input(job, upstream, where)
    text = job.input.messages_column or job.input.prompt_column
    if upstream is None and text is not None and text not in job.output.keep_columns:
        job.output.keep_columns.append(text)  # carried on: later stages read the prompt
    names = [renames.get(c, c) for c in job.output.keep_columns]
    clash = sorted({n for n in names if names.count(n) > 1} | (set(names) & own))
    if clash:
        raise JobError(f"{where}: output.keep_columns: {clash[0]!r} would be written twice; rename it with "
                       "output.rename_columns")
    task_columns = TASK_COLUMNS.get(job.task, ())
    columns = ["id", *task_columns, *(metric_column(m) for m in job.metrics), *judge_columns(merged, base_dir), *names]
    stage = Stage(raw["name"], job.task, upstream.name if upstream else None, output_path, job=job,
                  columns=list(dict.fromkeys(columns)))
    if text is not None:
        stage.prompt_column, stage.is_messages = text, job.input.messages_column is not None
    elif upstream is not None:  # a template: the prompt the earlier stages carried is still there
        stage.prompt_column, stage.is_messages = upstream.prompt_column, upstream.is_messages
    stage.system_prompt = job.input.system_prompt if upstream is None else upstream.system_prompt
    return stage


def _check_stage_input(job: JobConfig, upstream: Stage, where: str) -> None:
    """The columns a model stage reads are ones its earlier stage writes (JobError naming the key)."""
    inp = job.input
    wanted = {name: ("input.prompt_template" if inp.prompt_template is not None else
                     "input.messages_column" if inp.messages_column is not None else "input.prompt_column")
              for name in inp.prompt_source_columns}
    if inp.scored_column is not None:
        wanted[inp.scored_column] = "input.continuations_column"
    wanted.update({name: f"sampling_columns.{key}" for key, name in job.sampling_columns.items()})
    if inp.schema_column is not None:
        wanted[inp.schema_column] = "input.schema_column"
    for name in job.output.keep_columns:
        wanted.setdefault(name, "output.keep_columns")
    for column, key in wanted.items():
        if column not in upstream.columns:
            raise JobError(f"{where}: {key}: column {column!r} is not in the output of stage {upstream.name!r} "
                           f"(its columns: {', '.join(upstream.columns)})")


def _resolve(path: str, base_dir: Path) -> str:
    if "://" in path or Path(path).is_absolute():
        return path
    return str(base_dir / path)
