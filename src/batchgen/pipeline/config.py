"""JobConfig: the job file contract (the README's job reference) as pydantic models, loading, `--set`
overrides, config hash."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from batchgen.engine.text.chat_template import ChatTemplateOptions, check_template_syntax, load_chat_template
from batchgen.engine.config import EngineConfig, SettingError
from batchgen.engine.text.generation_config import AUTO as GENERATION_AUTO
from batchgen.engine.text.generation_config import NONE as GENERATION_NONE
from batchgen.engine.loader.source import BUNDLED_ALIASES, is_repo_id
from batchgen.engine.sampling.sampling_params import SamplingParams
from batchgen.engine.decoding.structured import StructuredOutputError, StructuredOutputsParams
from batchgen.pipeline import structured_job
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.job_settings import (
    ENGINE_ONLY,
    HASHED_WHEN_SET,
    JOB_DEFAULTS,
    KV_CACHE_HASH_KEYS,
    MODEL_KEYS,
    MODEL_PATH_FIELD,
    ROW_OVERRIDABLE,
    SAMPLING_ONLY,
    SAMPLING_RENAMED,
)
from batchgen.pipeline.batch_file import (
    BATCH_FORMAT,
    BATCH_ID_COLUMN,
    BATCH_LINE_COLUMN,
    is_batch_path,
)

_PATH_KEYS = {("model", "path"), ("input", "path"), ("output", "path"), ("model", "generation_config"),
              ("input", "chat_template"), ("sampling", "structured", "json_file")}
CONTINUATION_KEYS = ("continuations_column", "continuation_column")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


def derive_section(name: str, owner: type, section: str, keys: Iterable[str],
                   base: type[BaseModel] = _Section) -> type[BaseModel]:
    """A pydantic section whose keys are fields of the dataclass `owner`, with its types and defaults
    (the job's where JOB_DEFAULTS says so). Values are checked by constructing `owner` (see JobConfig)."""
    hints = typing.get_type_hints(owner)
    fields = {f.name: f for f in dataclasses.fields(owner)}
    definitions: dict[str, Any] = {}
    for key in keys:
        if (section, key) in JOB_DEFAULTS:
            default = JOB_DEFAULTS[section, key][0]
        elif fields[key].default_factory is not dataclasses.MISSING:
            default = Field(default_factory=fields[key].default_factory)
        else:
            default = fields[key].default
        definitions[key] = (hints[key], default)
    return create_model(name, __base__=base, **definitions)


def engine_keys(owner: type = EngineConfig) -> list[str]:
    """EngineConfig fields under `engine:`: all but model.path, the model keys and the engine-only ones."""
    return [f.name for f in dataclasses.fields(owner)
            if f.name not in (MODEL_PATH_FIELD, *MODEL_KEYS, *ENGINE_ONLY)]


def sampling_keys(owner: type = SamplingParams) -> list[str]:
    """SamplingParams fields under `sampling:` by their own name: all but the engine-only and renamed ones."""
    renamed = {field for field, _ in SAMPLING_RENAMED.values()}
    return [f.name for f in dataclasses.fields(owner) if f.name not in SAMPLING_ONLY and f.name not in renamed]


class _ModelPath(_Section):
    path: str = Field(min_length=1)


ModelSection = derive_section("ModelSection", EngineConfig, "model", MODEL_KEYS, base=_ModelPath)
EngineSection = derive_section("EngineSection", EngineConfig, "engine", engine_keys())
class _SamplingBase(_Section):
    """The sampling keys that are not SamplingParams fields of the same name (SAMPLING_RENAMED)."""

    structured: dict[str, Any] | None = None  # structured_job.py; builds SamplingParams.structured_outputs
    _schema_file: dict | None = PrivateAttr(default=None)  # structured.json_file's content, once read

    @field_validator("structured")
    @classmethod
    def _check_structured_keys(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        problem = structured_job.check_keys(value or {})
        if problem:
            raise ValueError(f"{problem[0]}: {problem[1]}")
        return value

    def constraint(self) -> StructuredOutputsParams | None:
        """The job's structured-output constraint (None: none, or json_file not read yet)."""
        return structured_job.job_constraint(self.structured, self._schema_file)


SamplingSection = derive_section("SamplingSection", SamplingParams, "sampling", sampling_keys(), base=_SamplingBase)

# sampling_columns: key -> the kind of column it needs (schema.py checks input columns against it).
_KINDS = {float: "float", int: "int", bool: "bool"}
_SAMPLING_TYPES = typing.get_type_hints(SamplingParams)
OVERRIDABLE_SAMPLING_KEYS = {key: _KINDS[_SAMPLING_TYPES[key]] for key in ROW_OVERRIDABLE}


InputFormat = Literal["auto", "parquet", "openai_batch"]
# input.* keys that mean nothing for an OpenAI batch file (each line's body holds its prompt and
# settings), with the one value they may hold there: any other value is refused rather than ignored.
# (Those values are what a batch job's own section holds, so a dumped job validates again.)
_BATCH_FILE_VALUES = {"id_column": BATCH_ID_COLUMN, "prompt_column": None, "messages_column": None,
                      "system_prompt": None, "apply_chat_template": True, "schema_column": None}


class InputSection(_Section):
    path: str = Field(min_length=1)
    format: InputFormat = "auto"  # auto: openai_batch for a path ending in .jsonl, else parquet
    id_column: str = "id"
    prompt_column: str | None = "prompt"
    messages_column: str | None = None
    # task: loglikelihood: the continuations to score after each row's prompt (the context)
    continuations_column: str | None = None  # a list of strings per row
    continuation_column: str | None = None  # or one string per row
    apply_chat_template: bool = True
    system_prompt: str | None = None
    on_overlong: Literal["error", "truncate_left"] = "error"
    rows_per_unit: int = Field(default=10000, ge=1)
    allow_duplicate_ids: bool = False  # true: repeated ids are separate requests (each its own samples)
    storage_options: dict[str, Any] = Field(default_factory=dict)  # fsspec options; not hashed
    allow_special_tokens: bool = False  # false: control-token text in prompts and messages is encoded as text
    max_prompt_bytes: int | None = Field(default=None, ge=1)  # null: max(1 MiB, 16 x max_model_len)
    # The chat template in place of the model's: a file (relative to the job file) or the template's text;
    # validate_job reads a file into its text. chat_template_kwargs: extra template variables.
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    schema_column: str | None = None  # a JSON schema per row (its JSON text); null cells: sampling.structured

    @field_validator("chat_template_kwargs")
    @classmethod
    def _check_template_kwargs(cls, value: dict[str, Any]) -> dict[str, Any]:
        ChatTemplateOptions(chat_template_kwargs=value)  # names a key that would clash with the call
        return value

    @property
    def chat_options(self) -> ChatTemplateOptions:
        """How this job's messages are rendered (a batch line may add its own settings)."""
        return ChatTemplateOptions(self.chat_template, chat_template_kwargs=self.chat_template_kwargs)

    @model_validator(mode="after")
    def _one_prompt_source(self) -> InputSection:
        if self.format == "auto":
            self.format = BATCH_FORMAT if is_batch_path(self.path) else "parquet"
        if self.format == BATCH_FORMAT:
            return self._as_batch_file()
        if self.messages_column is not None:
            if "prompt_column" in self.model_fields_set and self.prompt_column is not None:
                raise ValueError("set prompt_column or messages_column, not both")
            self.prompt_column = None
            if not self.apply_chat_template:
                raise ValueError("messages_column needs apply_chat_template: true (messages go through the template)")
        elif self.prompt_column is None:
            raise ValueError("set prompt_column (raw text) or messages_column (chat messages)")
        if self.system_prompt is not None and not self.apply_chat_template:
            raise ValueError("system_prompt needs apply_chat_template: true")
        if (self.chat_template is not None or self.chat_template_kwargs) and not self.apply_chat_template:
            raise ValueError("chat_template and chat_template_kwargs need apply_chat_template: true")
        return self

    def _as_batch_file(self) -> InputSection:
        given = [key for key, value in _BATCH_FILE_VALUES.items()
                 if key in self.model_fields_set and getattr(self, key) != value]
        if given:
            raise ValueError(f"format openai_batch takes no {', '.join(given)} (each line's custom_id is its "
                             "id, its url and body say how to prompt); remove them")
        if self.allow_duplicate_ids:
            raise ValueError("allow_duplicate_ids must be false with format openai_batch: a custom_id names "
                             "one line of output.jsonl, as in OpenAI's Batch API")
        self.id_column, self.prompt_column, self.messages_column = BATCH_ID_COLUMN, None, None
        return self

    @property
    def is_batch_file(self) -> bool:
        return self.format == BATCH_FORMAT

    @property
    def scored_column(self) -> str | None:
        """The column of continuations to score (task: loglikelihood), whichever kind it is."""
        return self.continuations_column or self.continuation_column

    @property
    def text_column(self) -> str:
        """The column holding the prompt, whichever kind it is (a batch file's whole line)."""
        if self.is_batch_file:
            return BATCH_LINE_COLUMN
        return self.messages_column or self.prompt_column


class BatchingSection(_Section):
    sort_by_length: bool = True
    window: int = Field(default=8192, ge=1)


class OutputSection(_Section):
    path: str = Field(default="", description="default: out/<name>/ beside the job file")
    # auto: openai_batch when the input is a batch file, else parquet. openai_batch also writes
    # output.jsonl and errors.jsonl (OpenAI's Batch API output) before _SUCCESS.
    format: InputFormat = "auto"
    keep_columns: list[str] = Field(default_factory=list)
    storage_options: dict[str, Any] = Field(default_factory=dict)  # fsspec options; not hashed


class ClusterSection(_Section):
    """Where the job runs: this process (local) or engine replicas on Ray. Not in the config hash:
    a row's output does not depend on where it ran."""

    backend: Literal["local", "ray"] = "local"
    address: str | None = None  # Ray's: null starts a local cluster (or joins RAY_ADDRESS); auto or ray://...
    replicas: int | Literal["auto"] = "auto"  # auto: one per GPU in the cluster, one on a CPU-only cluster
    gpus_per_replica: float = Field(default=1, ge=0)
    cpus_per_replica: float | None = Field(default=None, ge=0)  # null: Ray's default for an actor

    @field_validator("replicas")
    @classmethod
    def _positive_replicas(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError("must be auto or >= 1")
        return value


class JobConfig(_Section):
    """One job file, validated. Paths are resolved (relative to the job file's folder) by `load_job`."""

    name: str = Field(min_length=1)
    # generate: each row's prompt is completed. loglikelihood (lm-evaluation-harness' name; vLLM's "score"
    # is a cross-encoder's): each row's prompt is a context whose given continuations are scored.
    task: Literal["generate", "loglikelihood"] = "generate"
    model: ModelSection
    engine: EngineSection = Field(default_factory=EngineSection)
    input: InputSection
    sampling: SamplingSection = Field(default_factory=SamplingSection)
    sampling_columns: dict[str, str] = Field(default_factory=dict)
    batching: BatchingSection = Field(default_factory=BatchingSection)
    output: OutputSection = Field(default_factory=OutputSection)
    cluster: ClusterSection = Field(default_factory=ClusterSection)
    # What model.generation_config filled into the sampling section (set by job_plan.plan_job).
    _generation_config: dict | None = PrivateAttr(default=None)

    @field_validator("sampling_columns")
    @classmethod
    def _check_sampling_columns(cls, value: dict[str, str]) -> dict[str, str]:
        unknown = sorted(set(value) - set(OVERRIDABLE_SAMPLING_KEYS))
        if unknown:
            raise ValueError(f"cannot override {', '.join(unknown)} per row; allowed keys: "
                             f"{', '.join(OVERRIDABLE_SAMPLING_KEYS)}")
        return value

    @model_validator(mode="after")
    def _check_formats(self) -> JobConfig:
        if self.output.format == "auto":
            self.output.format = self.input.format
        errors = []
        if self.input.is_batch_file and self.sampling_columns:
            errors.append(_key_error(("sampling_columns",), "does not apply to input.format openai_batch: "
                                     "each line's body sets its own sampling fields", self.sampling_columns))
        errors += self._task_errors()
        if self.input.is_batch_file and self.output.keep_columns:
            errors.append(_key_error(("output", "keep_columns"), "does not apply to input.format "
                                     "openai_batch: a batch file has no columns besides custom_id (the output's id)",
                                     self.output.keep_columns))
        if self.writes_batch_output and self.input.allow_duplicate_ids:
            errors.append(_key_error(("input", "allow_duplicate_ids"), "must be false with output.format "
                                     "openai_batch: each id is one line's custom_id", True))
        if errors:
            raise ValidationError.from_exception_data(type(self).__name__, errors)
        return self

    def _task_errors(self) -> list[InitErrorDetails]:
        """What a loglikelihood job needs (continuations to score) and what it cannot take."""
        inp, sampling = self.input, self.sampling
        given = [key for key in CONTINUATION_KEYS if getattr(inp, key) is not None]
        # Scoring and beam search fork sequences, whose copy on write tensor parallelism does not run yet.
        forks = ("task: loglikelihood" if self.is_scoring
                 else "sampling.beam_width > 1" if sampling.beam_width > 1 else None)
        errors = [] if forks is None or self.engine.tensor_parallel_size == 1 else [
            _key_error(("engine", "tensor_parallel_size"), f"must be 1 with {forks} (not implemented with "
                       "tensor parallelism)", self.engine.tensor_parallel_size)]
        if sampling.beam_width > 1 and inp.schema_column is not None:
            errors.append(_key_error(("input", "schema_column"), "must be null with sampling.beam_width > 1 (beams "
                                     "are not constrained)", inp.schema_column))
        if not self.is_scoring:
            return errors + [_key_error(("input", key), "applies to task: loglikelihood only", getattr(inp, key))
                             for key in given]
        if len(given) != 1:
            errors.append(_key_error(("input", "continuations_column"), "task: loglikelihood needs one of "
                                     "input.continuations_column (a list of strings per row) or "
                                     "input.continuation_column (one string)", None))
        if inp.is_batch_file:
            errors.append(_key_error(("input", "format"), "must be parquet with task: loglikelihood (an OpenAI "
                                     "batch line is a generation request)", inp.format))
        if self.output.format == BATCH_FORMAT:
            errors.append(_key_error(("output", "format"), "must be parquet with task: loglikelihood",
                                     self.output.format))
        rule = "task: loglikelihood scores the given continuations: it samples nothing, leave it at its default"
        for key in ("n", "beam_width"):
            if getattr(sampling, key) != 1:
                errors.append(_key_error(("sampling", key), f"must be 1 with task: loglikelihood ({rule})",
                                         getattr(sampling, key)))
        if sampling.logprobs not in (None, False, True, 0):
            errors.append(_key_error(("sampling", "logprobs"), "must be false or true with task: loglikelihood "
                                     "(true: each continuation token's log-probability; no top N)",
                                     sampling.logprobs))
        if self.sampling_columns:
            errors.append(_key_error(("sampling_columns",), f"does not apply to task: loglikelihood ({rule})",
                                     self.sampling_columns))
        if sampling.structured is not None:
            errors.append(_key_error(("sampling", "structured"), f"does not apply to task: loglikelihood ({rule})",
                                     sampling.structured))
        if inp.schema_column is not None:
            errors.append(_key_error(("input", "schema_column"), f"does not apply to task: loglikelihood ({rule})",
                                     inp.schema_column))
        return errors

    @property
    def is_scoring(self) -> bool:
        """task: loglikelihood: rows score given continuations instead of generating."""
        return self.task == "loglikelihood"

    @property
    def writes_batch_output(self) -> bool:
        """output.format openai_batch: the job also writes output.jsonl and errors.jsonl."""
        return self.output.format == BATCH_FORMAT

    @model_validator(mode="after")
    def _check_by_constructing(self) -> JobConfig:
        """The engine's checks are the job's: build what a run builds, and name the key that fails."""
        errors = []
        try:
            self.engine_config()
        except SettingError as exc:
            section = "model" if exc.name in (MODEL_PATH_FIELD, *MODEL_KEYS) else "engine"
            key = "path" if exc.name == MODEL_PATH_FIELD else exc.name
            errors.append(_key_error((section, key), exc.rule, exc.value))
        try:
            params = self.sampling_params()
        except SettingError as exc:
            errors.append(_key_error(("sampling", exc.name), exc.rule, exc.value))
        except StructuredOutputError as exc:
            errors.append(_structured_error(exc, self.sampling.structured))
        else:
            # null: checked against the model's own (preflight); a loglikelihood job generates nothing
            if self.model.max_model_len is not None and not self.is_scoring:
                rule = max_tokens_rule(params.max_tokens, self.model.max_model_len)
                if rule:
                    errors.append(_key_error(("sampling", "max_tokens"), rule, params.max_tokens))
        if errors:
            raise ValidationError.from_exception_data(type(self).__name__, errors)
        return self

    def engine_config(self) -> EngineConfig:
        """The engine's config for this job: the `model` section (path -> model) and the `engine` section."""
        model = self.model.model_dump()
        return EngineConfig(**{MODEL_PATH_FIELD: model.pop("path")}, **model, **self.engine.model_dump())

    def sampling_params(self, **row_overrides: Any) -> SamplingParams:
        """The job's SamplingParams (the `sampling` section), with a row's overrides if given (a row's
        schema: `structured_outputs`)."""
        values = self.sampling.model_dump(exclude=set(SAMPLING_RENAMED))
        values["structured_outputs"] = self.sampling.constraint()
        return SamplingParams(**{**values, **row_overrides})

    def config_hash(self, limit: int | None = None) -> str:
        """sha256 over what changes outputs: model, input, sampling, sampling_columns, the KV cache's
        format when not the default (engine.kv_cache_dtype, engine.calculate_kv_scales: FP8 KV changes
        the numbers) and --limit, if set.

        Engine knobs other than the KV cache's, batching, cluster, output and storage options
        (credentials) are left out; a job with the default KV cache keeps the hash it had before
        these keys existed.
        """
        # The formats enter the hash only when not parquet, so the hash of every Parquet job stays what
        # it was before the formats existed (its output folders still resume).
        excluded = {"storage_options"} | ({"format"} if self.input.format == "parquet" else set())
        if self.input.schema_column is None:  # keys added later enter the hash only when set
            excluded.add("schema_column")
        sampling = _without_unset_new_keys(self.sampling, "sampling", {"structured"})
        constraint = self.sampling.constraint()
        if constraint is not None:  # its canonical key: a schema file's content (not its path) and its
            sampling["structured"] = constraint.key  # property order, which shapes the grammar
        payload = {
            "model": _without_unset_new_keys(self.model, "model"),
            "input": _without_unset_new_keys(self.input, "input", excluded),
            "sampling": sampling,
            "sampling_columns": dict(sorted(self.sampling_columns.items())),
        }
        if self.is_scoring:
            payload["task"] = self.task
        kv_cache = {key: getattr(self.engine, key) for key in KV_CACHE_HASH_KEYS
                    if getattr(self.engine, key) != getattr(EngineConfig, key)}
        if kv_cache:
            payload["kv_cache"] = kv_cache
        if self.writes_batch_output:  # its parts carry the openai_line column
            payload["output_format"] = self.output.format
        if limit is not None:  # a limited run covers different rows: its units must not pass for complete
            payload["limit"] = limit
        blob = json.dumps(payload, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()


    @property
    def generation_config_record(self) -> dict:
        """What `_SUCCESS` says of model.generation_config: the setting, the file read, the sampling
        defaults it gave this job (the keys the job file did not set)."""
        if self._generation_config is not None:
            return dict(self._generation_config)
        return {"setting": self.model.generation_config, "file": None, "applied": {}}

    def record_generation_config(self, setting: str, file: str | None, applied: dict) -> None:
        self._generation_config = {"setting": setting, "file": file, "applied": dict(applied)}


def _without_unset_new_keys(section: BaseModel, name: str, excluded: set[str] = frozenset()) -> dict:
    """The section's values for the hash, less HASHED_WHEN_SET keys still at their default."""
    values = section.model_dump(exclude=set(excluded))
    for key in HASHED_WHEN_SET.get(name, ()):
        if key in values and values[key] == type(section).model_fields[key].get_default(call_default_factory=True):
            del values[key]
    return values


def max_tokens_rule(max_tokens: int, max_model_len: int, origin: str = "model.max_model_len") -> str | None:
    """What is wrong with max_tokens against a context length (None: nothing): prompt + completion
    must fit, and a prompt has at least one token."""
    if max_tokens >= max_model_len:
        return f"must be below {origin} ({max_model_len})"
    return None


def _structured_error(exc: StructuredOutputError, values: dict | None) -> InitErrorDetails:
    """sampling.structured.<key>: the constraint's field (a schema file's problems name json_file)."""
    key = exc.field
    if key == "json" and values and structured_job.FILE_KEY in values:
        key = structured_job.FILE_KEY
    loc = ("sampling", "structured", key) if key else ("sampling", "structured")
    return _key_error(loc, exc.reason, None)


def _key_error(loc: tuple[str, ...], rule: str, value: Any) -> InitErrorDetails:
    error = PydanticCustomError("setting", "{rule}", {"rule": rule})
    return InitErrorDetails(type=error, loc=loc, input=value)


# ---- loading ----------------------------------------------------------------------------------------

def load_job(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """Read a job file, apply `section.key=value` overrides, validate, resolve relative paths.

    Raises JobError naming the file and key path on any problem.
    """
    job_path = Path(path)
    try:
        raw = yaml.safe_load(job_path.read_text())
    except FileNotFoundError:
        raise JobError(f"job file {job_path} not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise JobError(f"cannot read job file {job_path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise JobError(f"{job_path} is not valid YAML: {exc}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise JobError(f"{job_path}: a job file is a mapping of sections (name, model, input, ...)")
    raw.setdefault("name", job_path.stem)
    for item in overrides:
        apply_override(raw, item)
    return validate_job(raw, job_path.resolve().parent, source=str(job_path))


def validate_job(raw: dict, base_dir: Path, source: str = "job") -> JobConfig:
    """Validate a job mapping and resolve its relative paths against `base_dir`."""
    try:
        job = JobConfig.model_validate(raw)
    except ValidationError as exc:
        raise JobError(f"{source}: invalid job\n" + format_validation_error(exc)) from None
    job.model.path = _resolve_model_path(job.model.path, base_dir)
    if job.model.generation_config not in (GENERATION_AUTO, GENERATION_NONE):  # a folder
        job.model.generation_config = _resolve_path(job.model.generation_config, base_dir)
    if job.input.chat_template is not None:
        try:
            job.input.chat_template = load_chat_template(job.input.chat_template, base_dir)
            check_template_syntax(job.input.chat_template)
        except ValueError as exc:
            raise JobError(f"{source}: invalid job\n  input.chat_template: {exc}") from None
    spec = job.engine.speculative
    if spec is not None and spec.model is not None:  # the draft model: a path like model.path
        job.engine.speculative = dataclasses.replace(spec, model=_resolve_model_path(spec.model, base_dir))
    job.input.path = _resolve_path(job.input.path, base_dir)
    _read_schema_file(job, base_dir, source)
    job.output.path = _resolve_path(job.output.path or _default_output_path(job.name, source), base_dir)
    return job


def _read_schema_file(job: JobConfig, base_dir: Path, source: str) -> None:
    """sampling.structured.json_file, resolved against the job's folder, read and checked as the
    job's constraint."""
    structured = job.sampling.structured
    if not structured or structured_job.FILE_KEY not in structured:
        return
    path = _resolve_path(structured[structured_job.FILE_KEY], base_dir)
    structured[structured_job.FILE_KEY] = path
    try:
        job.sampling._schema_file = structured_job.read_schema_file(path)
        job.sampling_params()
    except JobError as exc:
        raise JobError(f"{source}: invalid job\n  {exc}") from None
    except StructuredOutputError as exc:
        raise JobError(f"{source}: invalid job\n  sampling.structured.json_file: {path}: {exc.reason}") from None


def _default_output_path(name: str, source: str) -> str:
    """out/<name> when the name is one folder name. Any other name (`../../x`) is refused, not
    rewritten: the output never lands outside out/, and its folder is the name the user wrote."""
    if name in (".", "..") or any(c in name for c in "/\\\0"):
        raise JobError(f"{source}: invalid job\n  name: {name!r} cannot name the default output folder "
                       "out/<name> (it must be one folder name: no '/', '\\' or NUL, not '.' or '..'); "
                       "rename the job or set output.path")
    return f"out/{name}"


def apply_override(raw: dict, item: str) -> None:
    """`section.key=value` into the raw mapping; the value is read as YAML (0.7 -> float, true -> bool)."""
    key, sep, text = item.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise JobError(f"--set {item!r}: expected section.key=value, e.g. --set sampling.temperature=0.7")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as exc:
        raise JobError(f"--set {item!r}: cannot read the value as YAML: {exc}") from None
    if tuple(parts) in _PATH_KEYS and isinstance(value, str) and not _is_uri(value) \
            and value.lower() not in BUNDLED_ALIASES and not _is_not_a_path(value, tuple(parts)):
        value = os.path.abspath(value)  # a path typed on the command line is relative to the cwd
    node = raw
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise JobError(f"--set {item!r}: {'.'.join(parts[:depth + 1])} is not a section")
        node = child
    node[parts[-1]] = value


def format_validation_error(exc: ValidationError) -> str:
    """One line per problem: the key path, what is wrong, the allowed values/keys, what was given."""
    lines = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        where = ".".join(loc) or "(top level)"
        if err["type"] == "extra_forbidden":
            allowed = ", ".join(_fields_at(loc[:-1]))
            lines.append(f"  {where}: unknown key; allowed keys here: {allowed}")
        elif err["type"] == "missing":
            lines.append(f"  {where}: required key is missing")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            given = err.get("input")
            suffix = "" if isinstance(given, dict) or given is None else f" (got {given!r})"
            lines.append(f"  {where}: {msg}{suffix}")
    return "\n".join(lines)


def _fields_at(loc: list[str]) -> list[str]:
    model: type[BaseModel] = JobConfig
    for part in loc:
        annotation = model.model_fields.get(part)
        if annotation is None or not isinstance(annotation.annotation, type) \
                or not issubclass(annotation.annotation, BaseModel):
            return []
        model = annotation.annotation
    return list(model.model_fields)


def _is_uri(path: str) -> bool:
    return "://" in path


def _resolve_path(path: str, base_dir: Path) -> str:
    if _is_uri(path) or os.path.isabs(path):
        return path
    resolved = str(base_dir / path)
    return resolved + "/" if path.endswith("/") else resolved


def _resolve_model_path(path: str, base_dir: Path) -> str:
    # An alias or a Hub repo id (org/name) stays a name unless a file or folder of that name is there.
    if (path.lower() in BUNDLED_ALIASES or is_repo_id(path)) and not (base_dir / path).exists():
        return path
    return _resolve_path(path, base_dir)


def _is_not_a_path(value: str, key: tuple[str, ...]) -> bool:
    """A --set value that is a name rather than a path: a Hub repo id for model.path (when no such
    folder is here), auto/vllm for generation_config, template text for chat_template."""
    if key == ("model", "path"):
        return is_repo_id(value) and not os.path.exists(value)
    if key == ("model", "generation_config"):
        return value in (GENERATION_AUTO, GENERATION_NONE)
    if key == ("input", "chat_template"):
        return any(mark in value for mark in "{}\n")
    return False
