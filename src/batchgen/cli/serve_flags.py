"""`batchgen serve`'s flags, generated from ServeConfig's fields (the server's own) and EngineConfig's
(one definition: a new setting is a flag at once, its docstring the flag's help).

Engine flags are named as vLLM names them: `max_num_seqs` is `--max-num-seqs`, a bool is `--x/--no-x`,
and VLLM_FLAG_NAMES lists where vLLM's name differs from the field's. Their values are read as YAML
scalars (JSON for objects) and checked by constructing EngineConfig, whose rule a bad value reports
under the flag's name. A job file (`.yaml`/`.yml`) in place of a model gives its `model` and `engine`
sections; flags override them.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
import yaml
from pydantic import TypeAdapter, ValidationError
from typer.core import TyperCommand

from batchgen.cli.console import help_text
from batchgen.config_docs import field_docs, format_default
from batchgen.engine.config import EngineConfig, SettingError
from batchgen.engine.text.chat_template import ChatTemplateOptions, check_template_syntax, load_chat_template
from batchgen.pipeline.config import load_job
from batchgen.pipeline.job_config import JobConfig
from batchgen.serve.settings import API_KEY_ENV, ServeConfig

# EngineConfig fields whose vLLM flag is not the field's name with dashes.
VLLM_FLAG_NAMES = {"speculative": "speculative-config"}
SERVER_PANEL = "Server"
ENGINE_PANEL = "Engine (EngineConfig's fields; default: the engine's, or the job file's)"
MODEL_OR_JOB_HELP = ("A model (bundled alias, HF folder, .gguf file, Hugging Face repo id) or a job file whose "
                     "model and engine sections to use.")
# What a server flag needs beyond its field's name, type, default and docstring.
SERVER_FLAG_DETAILS = {
    "api_key": {"envvar": API_KEY_ENV, "show_envvar": True},
    "chat_template": {"metavar": "FILE_OR_TEMPLATE"},
    "served_model_name": {"metavar": "NAME [NAME ...]"},
    "lora_modules": {"metavar": "NAME=PATH [NAME=PATH ...]"},
}


def flag_name(name: str) -> str:
    """A field's flag: `max_num_seqs` -> `--max-num-seqs` (vLLM's name where VLLM_FLAG_NAMES says)."""
    return "--" + VLLM_FLAG_NAMES.get(name, name.replace("_", "-"))


def _option(name: str, annotation: Any, default: Any, option: Any) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                             annotation=Annotated[annotation, option])


def server_parameters(config_class: type = ServeConfig) -> list[inspect.Parameter]:
    """One option per field of `config_class` (ServeConfig), with its type, default and docstring."""
    hints, docs = typing.get_type_hints(config_class), field_docs(config_class)
    params = []
    for f in dataclasses.fields(config_class):
        hint, details = _without_none(hints[f.name]), dict(SERVER_FLAG_DETAILS.get(f.name, {}))
        if typing.get_origin(hint) in (tuple, list):  # a list of values after one flag (vLLM's nargs +)
            hint = list[typing.get_args(hint)[0]]
        annotation = hint if f.default is not None else Optional[hint]
        option = typer.Option(flag_name(f.name), help=help_text(docs[f.name]), rich_help_panel=SERVER_PANEL,
                              show_default=f.default is not None, **details)
        params.append(_option(f.name, annotation, f.default, option))
    return params


def engine_parameters(config_class: type = EngineConfig) -> list[inspect.Parameter]:
    """One option per field of `config_class` (EngineConfig) but `model`; unset (None) unless given."""
    hints, docs = typing.get_type_hints(config_class), field_docs(config_class)
    params = []
    for f in dataclasses.fields(config_class):
        if f.name == "model":
            continue
        flag, default = flag_name(f.name), f.default if f.default is not dataclasses.MISSING else None
        text = help_text(f"{docs.get(f.name, f.name)} (engine default: {format_default(default)})")
        if hints[f.name] is bool:
            option = typer.Option(f"{flag}/--no-{flag[2:]}", help=text, rich_help_panel=ENGINE_PANEL,
                                  show_default=False)
            params.append(_option(f.name, Optional[bool], None, option))
        else:
            option = typer.Option(flag, metavar="VALUE", help=text, rich_help_panel=ENGINE_PANEL,
                                  show_default=False)
            params.append(_option(f.name, Optional[str], None, option))
    return params


def _without_none(hint: Any) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if type(None) in typing.get_args(hint) and len(args) == 1 else hint


def serve_signature(config_class: type = EngineConfig) -> inspect.Signature:
    """MODEL_OR_JOB, the server's flags, the engine's: what typer builds `batchgen serve` from."""
    target = inspect.Parameter("model_or_job", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Annotated[
        str, typer.Argument(metavar="MODEL_OR_JOB", help=MODEL_OR_JOB_HELP, show_default=False)])
    server, engine = server_parameters(), engine_parameters(config_class)
    clash = {p.name for p in server} & {p.name for p in engine}
    assert not clash, f"ServeConfig and {config_class.__name__} both have {clash}"
    return inspect.Signature([target, *server, *engine])


class ServeCommand(TyperCommand):
    """typer's command, where `--served-model-name A B` takes every name up to the next flag (vLLM's
    argparse nargs='+', which click has no option for)."""

    variadic_flags = (flag_name("served_model_name"), flag_name("lora_modules"))

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        """vLLM's `--served-model-name A B` (several values after one flag) spread into click's
        repeated form before click parses."""
        return super().parse_args(ctx, spread_variadic(args, self.variadic_flags))


def spread_variadic(args: list[str], flags: tuple[str, ...]) -> list[str]:
    """`--f a b --g` -> `--f a --f b --g` for the flags in `flags` (click repeats a multiple option)."""
    spread, i = [], 0
    while i < len(args):
        if args[i] == "--":
            return spread + args[i:]
        if args[i] not in flags:
            spread.append(args[i])
            i += 1
            continue
        values = []
        while i + 1 + len(values) < len(args) and not args[i + 1 + len(values)].startswith("-"):
            values.append(args[i + 1 + len(values)])
        spread += [part for value in values for part in (args[i], value)] if values else [args[i]]
        i += 1 + len(values)
    return spread


@dataclass(frozen=True)
class ServeFlags:
    """A `batchgen serve` command line, read: the argument, the server's flags, the engine flags given."""

    model_or_job: str
    server: dict[str, Any]
    engine: dict[str, str | bool]
    engine_class: type = EngineConfig

    @classmethod
    def from_params(cls, params: dict[str, Any], engine_class: type = EngineConfig) -> ServeFlags:
        """From the command's parameters (typer's keyword arguments): an engine flag not given is None."""
        server_names = {f.name for f in dataclasses.fields(ServeConfig)}
        engine_names = {f.name for f in dataclasses.fields(engine_class)}
        return cls(params["model_or_job"], {k: v for k, v in params.items() if k in server_names},
                   {k: v for k, v in params.items() if k in engine_names and v is not None}, engine_class)

    @functools.cached_property
    def job(self) -> JobConfig | None:
        """The job file MODEL_OR_JOB names (JobError when it is bad); None for a model."""
        target = self.model_or_job
        is_job = Path(target).suffix in (".yaml", ".yml") and Path(target).is_file()
        return load_job(target) if is_job else None

    def serve_config(self) -> ServeConfig:
        """The server's settings; ValueError naming the flag of a bad value."""
        values = dict(self.server)
        if values.get("served_model_name") is not None:
            values["served_model_name"] = tuple(values["served_model_name"]) or None
        if values.get("lora_modules") is not None:
            values["lora_modules"] = tuple(values["lora_modules"]) or None
        if values.get("lora_modules") is None and self.job is not None and self.job.model.lora_modules:
            # a job file's adapters are served under their names (--lora-modules replaces them)
            values["lora_modules"] = tuple(f"{name}={path}" for name, path in self.job.model.lora_modules.items())
        try:
            return ServeConfig(**values)
        except SettingError as exc:
            raise ValueError(f"{flag_name(exc.name)} {exc.rule} (got {exc.value!r})") from None

    def engine_config(self) -> EngineConfig:
        """EngineConfig from MODEL_OR_JOB and the engine flags given; ValueError naming the flag."""
        hints = typing.get_type_hints(self.engine_class)
        values = {}
        for name, raw in self.engine.items():
            value = raw if isinstance(raw, bool) else yaml.safe_load(raw)
            try:
                values[name] = TypeAdapter(hints[name]).validate_python(value)
            except ValidationError:
                raise ValueError(f"{flag_name(name)}: cannot read {raw!r} as {hints[name]}") from None
        try:
            if self.job is None:
                return self.engine_class(model=self.model_or_job, **values)
            if "generation_config" not in self.job.model.model_fields_set:
                # A job's default (vllm: its sampling section is its defaults) is not a server's: unset
                # request fields take the model's generation_config.json, as vLLM's server does.
                values.setdefault("generation_config", EngineConfig.generation_config)
            config = self.job.engine_config()
            if config.merged_lora is not None and "merged_lora" not in values:
                # a job's one adapter is merged for the job's rows; a server serves it by name beside the base
                config = config.replace(merged_lora=None, enable_lora=True)
            return config.replace(**values)
        except SettingError as exc:
            raise ValueError(f"{flag_name(exc.name)} {exc.rule} (got {exc.value!r})") from None

    def chat_options(self) -> ChatTemplateOptions:
        """--chat-template (a file or the template's text), else a job file's input.chat_template and
        chat_template_kwargs; the template's syntax is checked here, before any model loads."""
        template, kwargs = None, {}
        if self.job is not None:
            template, kwargs = self.job.input.chat_template, self.job.input.chat_template_kwargs
        if self.server.get("chat_template") is not None:
            template = load_chat_template(self.server["chat_template"])
        if template is not None:
            check_template_syntax(template)
        return ChatTemplateOptions(template, chat_template_kwargs=kwargs)
