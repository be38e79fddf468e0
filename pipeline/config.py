"""JobConfig: the job file contract (design.md) as pydantic models, loading, `--set` overrides, config hash."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from batchgen.engine.config import EngineConfig, parse_memory_size
from batchgen.engine.loader.source import BUNDLED_ALIASES
from batchgen.pipeline.errors import JobError

# SamplingParams fields a per-row column may override (n, seed and logprobs change the job's shape
# or its reproducibility contract, so they stay job-wide).
OVERRIDABLE_SAMPLING_KEYS = {
    "temperature": "float", "top_p": "float", "top_k": "int", "min_p": "float",
    "repetition_penalty": "float", "presence_penalty": "float", "frequency_penalty": "float",
    "max_tokens": "int", "min_tokens": "int", "ignore_eos": "bool",
}
_PATH_KEYS = {("model", "path"), ("input", "path"), ("output", "path")}


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSection(_Section):
    path: str = Field(min_length=1)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    quantization: Literal["none", "fp8"] = "none"
    fp8_mode: Literal["auto", "w8a8", "w8a16"] = "auto"
    max_model_len: int | None = Field(default=4096, ge=2)  # null: the model's own context length


class EngineSection(_Section):
    device: str = "auto"
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    block_size: int = Field(default=16, ge=1)
    max_num_seqs: int = Field(default=128, ge=1)
    max_num_batched_tokens: int = Field(default=4096, ge=1)
    enable_prefix_caching: bool = True
    kv_cache_memory: str | int | float = "auto"

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
            raise ValueError(f"must be one of auto, cpu, cuda, cuda:N; got {value!r}")
        return value

    @field_validator("kv_cache_memory")
    @classmethod
    def _check_kv_cache_memory(cls, value: str | float) -> str | float:
        if value != "auto":
            parse_memory_size(value)  # raises ValueError with the accepted forms
        return value


class InputSection(_Section):
    path: str = Field(min_length=1)
    id_column: str = "id"
    prompt_column: str | None = "prompt"
    messages_column: str | None = None
    apply_chat_template: bool = True
    system_prompt: str | None = None
    on_overlong: Literal["error", "truncate_left"] = "error"
    rows_per_unit: int = Field(default=10000, ge=1)
    storage_options: dict[str, Any] = Field(default_factory=dict)  # fsspec options; not hashed
    allow_special_tokens: bool = False  # false: control-token text in prompts and messages is encoded as text
    max_prompt_bytes: int | None = Field(default=None, ge=1)  # null: max(1 MiB, 16 x max_model_len)

    @model_validator(mode="after")
    def _one_prompt_source(self) -> InputSection:
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
        return self

    @property
    def text_column(self) -> str:
        """The column holding the prompt, whichever kind it is."""
        return self.messages_column or self.prompt_column


class SamplingSection(_Section):
    temperature: float = Field(default=0.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = -1
    min_p: float = Field(default=0.0, ge=0, le=1)
    repetition_penalty: float = Field(default=1.0, gt=0)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    max_tokens: int = Field(default=256, ge=1)
    min_tokens: int = Field(default=0, ge=0)
    n: int = Field(default=1, ge=1)
    seed: int = 0
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False

    @field_validator("top_k")
    @classmethod
    def _check_top_k(cls, value: int) -> int:
        if value != -1 and value < 1:
            raise ValueError(f"must be -1 (off) or >= 1; got {value}")
        return value

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: list[str]) -> list[str]:
        if any(not s for s in value):
            raise ValueError("stop strings must be non-empty")
        return value

    @model_validator(mode="after")
    def _check_combination(self) -> SamplingSection:
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.n > 1 and self.temperature == 0:
            raise ValueError(f"n={self.n} needs temperature > 0 (greedy sampling gives n identical samples)")
        return self


class BatchingSection(_Section):
    sort_by_length: bool = True
    window: int = Field(default=8192, ge=1)


class OutputSection(_Section):
    path: str = Field(default="", description="default: out/<name>/ beside the job file")
    keep_columns: list[str] = Field(default_factory=list)
    storage_options: dict[str, Any] = Field(default_factory=dict)  # fsspec options; not hashed


class JobConfig(_Section):
    """One job file, validated. Paths are resolved (relative to the job file's folder) by `load_job`."""

    name: str = Field(min_length=1)
    model: ModelSection
    engine: EngineSection = Field(default_factory=EngineSection)
    input: InputSection
    sampling: SamplingSection = Field(default_factory=SamplingSection)
    sampling_columns: dict[str, str] = Field(default_factory=dict)
    batching: BatchingSection = Field(default_factory=BatchingSection)
    output: OutputSection = Field(default_factory=OutputSection)

    @field_validator("sampling_columns")
    @classmethod
    def _check_sampling_columns(cls, value: dict[str, str]) -> dict[str, str]:
        unknown = sorted(set(value) - set(OVERRIDABLE_SAMPLING_KEYS))
        if unknown:
            raise ValueError(f"cannot override {', '.join(unknown)} per row; allowed keys: "
                             f"{', '.join(OVERRIDABLE_SAMPLING_KEYS)}")
        return value

    @model_validator(mode="after")
    def _check_lengths(self) -> JobConfig:
        limit = self.model.max_model_len
        if limit is not None and self.sampling.max_tokens >= limit:
            raise ValueError(f"sampling.max_tokens ({self.sampling.max_tokens}) must be below "
                             f"model.max_model_len ({limit})")
        return self

    def engine_config(self) -> EngineConfig:
        """The engine's config for this job (the `model` and `engine` sections)."""
        m, e = self.model, self.engine
        return EngineConfig(
            model=m.path, dtype=m.dtype, quantization=m.quantization, fp8_mode=m.fp8_mode,
            max_model_len=m.max_model_len, device=e.device, attention_backend=e.attention_backend,
            block_size=e.block_size, max_num_seqs=e.max_num_seqs,
            max_num_batched_tokens=e.max_num_batched_tokens, enable_prefix_caching=e.enable_prefix_caching,
            kv_cache_memory=e.kv_cache_memory)

    def config_hash(self, limit: int | None = None) -> str:
        """sha256 over what changes outputs: model, input, sampling, sampling_columns (and --limit, if set).

        Engine knobs, batching, output and storage options (credentials) are left out.
        """
        payload = {
            "model": self.model.model_dump(),
            "input": self.input.model_dump(exclude={"storage_options"}),
            "sampling": self.sampling.model_dump(),
            "sampling_columns": dict(sorted(self.sampling_columns.items())),
        }
        if limit is not None:  # a limited run covers different rows: its units must not pass for complete
            payload["limit"] = limit
        blob = json.dumps(payload, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()


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
    job.input.path = _resolve_path(job.input.path, base_dir)
    job.output.path = _resolve_path(job.output.path or _default_output_path(job.name, source), base_dir)
    return job


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
            and value.lower() not in BUNDLED_ALIASES:
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
    if path.lower() in BUNDLED_ALIASES and not (base_dir / path).exists():
        return path
    return _resolve_path(path, base_dir)
