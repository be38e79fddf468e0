"""The job file: loading, `--set` overrides, validation and path resolution; the one import place of
the job contract (JobConfig in job_config.py, its sections in job_sections.py, which fields sit where
in job_settings.py)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import yaml
from pydantic import BaseModel, ValidationError

from batchgen.engine.decoding.structured import StructuredOutputError
from batchgen.engine.loader.source import BUNDLED_ALIASES, is_repo_id
from batchgen.engine.text.chat_template import check_template_syntax, load_chat_template
from batchgen.engine.text.generation_config import AUTO as GENERATION_AUTO
from batchgen.engine.text.generation_config import NONE as GENERATION_NONE
from batchgen.pipeline import structured_job
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.job_config import CONTINUATION_KEYS, JobConfig, max_tokens_rule
from batchgen.pipeline.job_sections import (
    OVERRIDABLE_SAMPLING_KEYS,
    BatchingSection,
    ClusterSection,
    EngineSection,
    InputSection,
    ModelSection,
    OutputSection,
    SamplingSection,
    derive_section,
    engine_keys,
    sampling_keys,
)

__all__ = [
    "CONTINUATION_KEYS", "OVERRIDABLE_SAMPLING_KEYS", "BatchingSection", "ClusterSection", "EngineSection",
    "InputSection", "JobConfig", "ModelSection", "OutputSection", "SamplingSection", "apply_override",
    "derive_section", "engine_keys", "format_validation_error", "load_job", "max_tokens_rule", "read_job_file",
    "sampling_keys", "validate_job",
]

_PATH_KEYS = {("model", "path"), ("input", "path"), ("output", "path"), ("model", "generation_config"),
              ("input", "chat_template"), ("sampling", "structured", "json_file")}

def load_job(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """Read a job file, apply `section.key=value` overrides, validate, resolve relative paths.

    Raises JobError naming the file and key path on any problem.
    """
    job_path = Path(path)
    raw = read_job_file(job_path, overrides)
    return validate_job(raw, job_path.resolve().parent, source=str(job_path))


def read_job_file(job_path: Path, overrides: list[str] | tuple[str, ...] = ()) -> dict:
    """A job file's mapping with its `--set` overrides applied and its name defaulted (not validated)."""
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
    return raw


def validate_job(raw: dict, base_dir: Path, source: str = "job") -> JobConfig:
    """Validate a job mapping and resolve its relative paths against `base_dir`."""
    try:
        job = JobConfig.model_validate(raw)
    except ValidationError as exc:
        raise JobError(f"{source}: invalid job\n" + format_validation_error(exc)) from None
    job.model.path = _resolve_model_path(job.model.path, base_dir)
    job.model.lora_modules = {name: _resolve_model_path(path, base_dir)  # folders or Hub repo ids, as model.path
                              for name, path in job.model.lora_modules.items()}
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
    if parts[0] == "stages" and isinstance(raw.get("stages"), list) and len(parts) > 2:
        # stages.<stage name>.section.key=value: into that stage of a multi-stage job
        node = next((s for s in raw["stages"] if isinstance(s, dict) and s.get("name") == parts[1]), None)
        if node is None:
            raise JobError(f"--set {item!r}: no stage named {parts[1]!r}")
        parts = parts[2:]
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
