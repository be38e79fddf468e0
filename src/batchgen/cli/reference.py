"""The generated reference: job keys, engine settings, server flags and commands, from the config classes'
field docstrings and the typer app (the text `--help` shows). The docs site's build hook calls
`render_reference_pages()` and adds each page under docs/ at its key."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import typer
from pydantic import BaseModel

from batchgen.cli.main import app
from batchgen.cli.markdown import cell, code, default_cell, table, type_name
from batchgen.cli.serve_flags import ENGINE_PANEL, SERVER_FLAG_DETAILS, flag_name
from batchgen.config_docs import field_docs
from batchgen.engine.config import EngineConfig, SpeculativeConfig
from batchgen.engine.sampling.sampling_params import SamplingParams
from batchgen.metrics import MetricSpec
from batchgen.pipeline.config import JobConfig
from batchgen.pipeline.job_settings import (
    ENGINE_ONLY,
    JOB_DEFAULTS,
    MODEL_KEYS,
    MODEL_PATH_FIELD,
    ROW_OVERRIDABLE,
    SAMPLING_ONLY,
    SAMPLING_RENAMED,
)
from batchgen.serve.settings import ServeConfig

GENERATED = ("*Generated from the config classes' field docstrings by `batchgen.cli.reference` (the text "
             "`--help` shows): edit a docstring, not this page.*")
# Sections whose keys are a dataclass's fields: where that dataclass is described.
SECTION_SOURCES = {"model": "EngineConfig", "engine": "EngineConfig", "sampling": "SamplingParams"}


def render_reference_pages() -> dict[str, str]:
    """Markdown pages keyed by their path under docs/."""
    return {"reference/job-file.md": job_file_page(), "reference/engine.md": engine_page(),
            "reference/server.md": server_page(), "reference/cli.md": cli_page()}


def job_file_page() -> str:
    """Every job key by section: name, type, default, docstring."""
    top = [(name, info) for name, info in JobConfig.model_fields.items() if not _is_section(info.annotation)]
    parts = ["# Job file reference", GENERATED,
             "A job file is YAML: the keys below, most in sections. Relative paths are relative to the job "
             "file's folder; `batchgen run JOB --set section.key=value` overrides a key (the value read as YAML).",
             _model_table(JobConfig, top, "")]
    for name, info in JobConfig.model_fields.items():
        if _is_section(info.annotation):
            parts += [f"## `{name}`", cell(info.description or "")]
            if name in SECTION_SOURCES:
                parts.append(f"Each key is `{SECTION_SOURCES[name]}`'s field of the same name (see "
                             "[engine settings](engine.md)), with its checks.")
            parts.append(_model_table(info.annotation, list(info.annotation.model_fields.items()), name + "."))
            parts += _section_notes(name)
    return _page(parts + metrics_reference())


def metrics_reference() -> list[str]:
    """`metrics.<name>`: each metric type's keys (besides `type`), from the spec classes' docstrings."""
    parts = ["## `metrics`",
             "Each metric is `metrics.<name>: {type: <type>, <keys below>}`; its verdicts are the output column "
             "`metric_<name>`, its aggregate `_SUCCESS`'s `metrics.<name>` (value, stderr, n). See the "
             "[metrics guide](../guides/metrics.md) for how each matches lm-evaluation-harness."]
    for spec in typing.get_args(typing.get_args(MetricSpec)[0]):
        types = typing.get_args(spec.model_fields["type"].annotation)
        parts += [f"### {' / '.join(f'`{t}`' for t in types)} ({spec.__name__})", cell(" ".join(spec.__doc__.split())),
                  _model_table(spec, _required_first(spec), "metrics.<name>.")]
    return parts


def _section_notes(section: str) -> list[str]:
    notes = []
    differing = [(key, reason) for (where, key), (_, reason) in JOB_DEFAULTS.items() if where == section]
    if differing:
        notes.append("Job defaults that differ from the engine's, and why:\n\n" + "\n".join(
            f"- `{section}.{key}`: {cell(reason)}" for key, reason in differing))
    if section == "engine":
        notes += ["### `engine.speculative`", cell(SpeculativeConfig.__doc__ or ""),
                  _dataclass_table(SpeculativeConfig, "engine.speculative."),
                  "EngineConfig fields that are not job keys:\n\n" + _reasons(ENGINE_ONLY)]
    if section == "sampling":
        notes.append("SamplingParams fields that are not job keys, or are under another name:\n\n"
                     + _reasons({**SAMPLING_ONLY, **{f"{field} (sampling.{key})": reason
                                                      for key, (field, reason) in SAMPLING_RENAMED.items()}}))
    if section == "input":
        notes.append("`sampling_columns` may name these sampling keys: "
                     + ", ".join(f"`{key}`" for key in ROW_OVERRIDABLE) + ".")
    return notes


def engine_page() -> str:
    """EngineConfig's fields (LLM(...) keywords), SpeculativeConfig's and SamplingParams'."""
    def job_key(name: str) -> str:
        if name == MODEL_PATH_FIELD:
            return code("model.path")
        if name in ENGINE_ONLY:
            return "none: " + cell(ENGINE_ONLY[name])
        return code(("model." if name in MODEL_KEYS else "engine.") + name)

    def sampling_key(name: str) -> str:
        renamed = {field: key for key, (field, _) in SAMPLING_RENAMED.items()}
        if name in SAMPLING_ONLY:
            return "none: " + cell(SAMPLING_ONLY[name])
        return code("sampling." + renamed.get(name, name))

    return _page([
        "# Engine settings", GENERATED,
        "`EngineConfig` is the engine's one config: `LLM(model, **settings)` takes its fields as keywords, "
        "a job file's `model` and `engine` sections are its fields, and `batchgen serve` has a flag for each "
        "([server flags](server.md)).",
        "## `EngineConfig`", _dataclass_table(EngineConfig, extra=("Job key", job_key)),
        "## `SpeculativeConfig`", cell(SpeculativeConfig.__doc__ or ""),
        _dataclass_table(SpeculativeConfig),
        "## `SamplingParams`", "How to sample one request (vLLM's names): `LLM.generate(prompts, params)`, "
        "and a job file's `sampling` section.", _dataclass_table(SamplingParams, extra=("Job key", sampling_key)),
    ])


def server_page() -> str:
    """`batchgen serve`'s flags: the server's own (ServeConfig), then one per EngineConfig field."""
    hints, docs = typing.get_type_hints(ServeConfig), field_docs(ServeConfig)
    server_rows = []
    for f in dataclasses.fields(ServeConfig):
        envvar = SERVER_FLAG_DETAILS.get(f.name, {}).get("envvar")
        text = docs[f.name] + (f" (environment variable: `{envvar}`)" if envvar else "")
        server_rows.append((code(flag_name(f.name)), cell(type_name(hints[f.name])), default_cell(f.default),
                            cell(text)))
    engine_rows = []
    engine_hints, engine_docs = typing.get_type_hints(EngineConfig), field_docs(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        if f.name == "model":
            continue
        flag = flag_name(f.name)
        flags = f"{code(flag)} / {code('--no-' + flag[2:])}" if engine_hints[f.name] is bool else code(flag)
        engine_rows.append((flags, code(f.name), default_cell(f.default), cell(engine_docs[f.name])))
    return _page([
        "# Server flags", GENERATED,
        "`batchgen serve MODEL_OR_JOB [flags]`: an OpenAI-compatible server (`/v1/chat/completions`, "
        "`/v1/completions`, `/v1/models`, `/health`, `/metrics`) on the engine; needs the serve extra "
        "(`pip install 'batchgen[serve]'`). MODEL_OR_JOB is a model (bundled alias, HF folder, `.gguf` file, "
        "Hugging Face repo id) or a job file, whose `model` and `engine` sections the flags override.",
        "## Server", table(("Flag", "Type", "Default", "Description"), server_rows),
        "`--served-model-name` takes one or more names (`--served-model-name a b`).",
        "## Engine", cell(ENGINE_PANEL) + ". Values are read as YAML (`--max-model-len 2048`, "
        "`--speculative-config '{\"method\": \"ngram\"}'`); a bool is `--x` / `--no-x`.",
        table(("Flag", "EngineConfig field", "Engine default", "Description"), engine_rows),
    ])


def cli_page() -> str:
    """The commands and their arguments and options, from the typer app."""
    group = typer.main.get_command(app)
    parts = ["# Commands", GENERATED, _paragraphs(group.help or "")]
    for name, command in group.commands.items():
        arguments = [p for p in command.params if p.param_type_name == "argument"]
        options = [p for p in command.params if p.param_type_name == "option" and p.name != "help"]
        usage = " ".join(["batchgen", name, "[OPTIONS]", *(a.metavar or a.name.upper() for a in arguments)])
        parts += [f"## `batchgen {name}`", f"```\n{usage}\n```", _paragraphs(command.help or "")]
        if arguments:
            parts.append(table(("Argument", "Description"),
                               [(code(a.metavar or a.name.upper()), cell(_help(getattr(a, "help", "") or "")))
                                for a in arguments]))
        if name == "serve":
            options = [p for p in options if getattr(p, "rich_help_panel", None) != ENGINE_PANEL]
            parts.append("Besides the options below, every engine setting is a flag: see "
                         "[server flags](server.md).")
        parts.append(table(("Option", "Value", "Default", "Description"), [_option_row(p) for p in options]))
    return _page(parts)


def _option_row(param: Any) -> tuple[str, ...]:
    names = " / ".join(code(n) for n in [*param.opts, *param.secondary_opts])
    value = "" if param.is_flag else cell(param.metavar or type_name(param.type_descriptor.annotation))
    default = "" if param.required or param.default in (None, (), []) else default_cell(param.default)
    return names, value, default, cell(_help(param.help or ""))


def _help(text: str) -> str:
    """Help text as markdown: without the escapes rich markup needed."""
    return text.replace("\\[", "[").strip()


def _paragraphs(text: str) -> str:
    """A command's help as markdown paragraphs (each escaped as a cell is)."""
    return "\n\n".join(cell(paragraph) for paragraph in _help(text).split("\n\n"))


def _model_table(model: type[BaseModel], fields: list[tuple[str, Any]], prefix: str) -> str:
    rows = [(code(prefix + name), cell(type_name(info.annotation)),
             "required" if info.is_required() else default_cell(info.get_default(call_default_factory=True)),
             cell(info.description or "")) for name, info in fields]
    return table(("Key", "Type", "Default", "Description"), rows)


def _dataclass_table(cls: type, prefix: str = "", extra: tuple[str, Any] | None = None) -> str:
    """A dataclass's fields (`prefix` before each name: a job key's section); `extra`: (column header,
    field name -> cell)."""
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    rows = []
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else (
            ... if f.default is dataclasses.MISSING else f.default)
        row = (code(prefix + f.name), cell(type_name(hints[f.name])),
               "required" if default is ... else default_cell(default))
        rows.append((*row, *((extra[1](f.name),) if extra else ()), cell(docs.get(f.name, ""))))
    header = ("Key" if prefix else "Field", "Type", "Default", *((extra[0],) if extra else ()), "Description")
    return table(header, rows)


def _required_first(spec: type[BaseModel]) -> list[tuple[str, Any]]:
    """A metric's keys but `type`: the required ones first, `min` (every metric's) last."""
    keys = [(k, v) for k, v in spec.model_fields.items() if k != "type"]
    return sorted(keys, key=lambda item: (not item[1].is_required(), item[0] == "min"))


def _reasons(reasons: dict[str, str]) -> str:
    return "\n".join(f"- `{name}`: {cell(reason)}" for name, reason in reasons.items())


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _page(parts: list[str]) -> str:
    return "\n\n".join(part for part in parts if part) + "\n"
