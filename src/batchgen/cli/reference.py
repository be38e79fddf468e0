"""PLACEHOLDER (docs branch): the site's generated reference pages.

The `cli` helper's module of the same name replaces this file at merge: it renders the pages from the
config classes' field docstrings (the text `--help` prints). This stand-in renders only names and
defaults so that the site (docs/hooks/reference.py) builds and its tests run; it keeps the contract:
`render_reference_pages() -> {path under docs/: markdown}` for reference/job-file.md, reference/engine.md,
reference/server.md and reference/cli.md.
"""

from __future__ import annotations

import dataclasses

import typer
import yaml
from pydantic import BaseModel

from batchgen.cli.main import app
from batchgen.cli.serve import build_parser
from batchgen.engine.config import EngineConfig
from batchgen.pipeline.config import JobConfig


def _default(field) -> object:
    if field.is_required():
        return "<required>"
    value = field.get_default(call_default_factory=True)
    return value.model_dump() if isinstance(value, BaseModel) else value


def _job_file_page() -> str:
    keys = {}
    for name, field in JobConfig.model_fields.items():
        section = field.annotation
        if isinstance(section, type) and issubclass(section, BaseModel):
            keys[name] = {key: _default(f) for key, f in section.model_fields.items()}
        else:
            keys[name] = _default(field)
    listing = yaml.safe_dump(keys, sort_keys=False, default_flow_style=False)
    return f"# Job file\n\nEvery key of a job file with its default.\n\n```yaml\n{listing}```\n"


def _engine_page() -> str:
    rows = [f"| `{f.name}` | `{f.default!r}` |" for f in dataclasses.fields(EngineConfig)
            if f.default is not dataclasses.MISSING]
    return "# Engine settings\n\n| field | default |\n|---|---|\n" + "\n".join(rows) + "\n"


def _server_page() -> str:
    return f"# Server flags\n\n```\n{build_parser().format_help()}```\n"


def _cli_page() -> str:
    group = typer.main.get_command(app)
    parts = ["# CLI\n"]
    for name, command in group.commands.items():
        options = [f"- `{' / '.join(param.opts)}`" for param in command.params
                   if param.param_type_name == "option"]
        parts.append(f"## batchgen {name}\n\n{command.help or ''}\n\n" + "\n".join(options) + "\n")
    return "\n".join(parts)


def render_reference_pages() -> dict[str, str]:
    """The generated pages, keyed by their path under docs/."""
    return {"reference/job-file.md": _job_file_page(), "reference/engine.md": _engine_page(),
            "reference/server.md": _server_page(), "reference/cli.md": _cli_page()}
