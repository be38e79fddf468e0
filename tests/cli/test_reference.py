"""The generated reference: every job key, engine field and serve flag with its docstring, every command
and option of the app, and tables that Python-Markdown (mkdocs) splits into the cells they were given."""

from __future__ import annotations

import dataclasses
import re

import pytest
import typer

from batchgen.cli.main import app
from batchgen.cli.reference import render_reference_pages
from batchgen.cli.serve_flags import flag_name
from batchgen.config_docs import field_docs
from batchgen.engine.config import EngineConfig, SpeculativeConfig
from batchgen.pipeline.config import JobConfig
from batchgen.serve.settings import ServeConfig
from tests.test_config_docs import job_sections

PAGES = render_reference_pages()


def one_line(text: str) -> str:
    return " ".join(text.split())


def test_the_pages_are_the_four_the_docs_site_adds():
    assert set(PAGES) == {"reference/job-file.md", "reference/engine.md", "reference/server.md", "reference/cli.md"}


def job_keys() -> list[str]:
    """Every job key by its path: `name`, `input.path`, `engine.speculative.method`, ..."""
    keys = []
    for name, info in JobConfig.model_fields.items():
        section = info.annotation
        if section in job_sections():
            keys += [f"{name}.{key}" for key in section.model_fields]
        else:
            keys.append(name)
    return keys + [f"engine.speculative.{f.name}" for f in dataclasses.fields(SpeculativeConfig)]


def test_the_job_file_page_holds_every_job_key_with_its_docstring():
    page = PAGES["reference/job-file.md"]
    keys = job_keys()
    assert {"name", "model.path", "engine.max_num_seqs", "sampling.temperature", "input.prompt_column",
            "output.keep_columns", "cluster.backend", "engine.speculative.method"} <= set(keys)
    for key in keys:
        assert f"| `{key}` |" in page, key
    docs = field_docs(EngineConfig)
    assert one_line(docs["kv_cache_memory"]).replace("|", "\\|") in page
    assert "EngineConfig" in page.split("## `engine`")[1].split("## ")[0]  # says where its keys come from


def test_the_engine_and_server_pages_hold_every_field_and_flag():
    engine, server = PAGES["reference/engine.md"], PAGES["reference/server.md"]
    for f in dataclasses.fields(EngineConfig):
        assert f"| `{f.name}` |" in engine, f.name
        if f.name != "model":
            assert f"`{flag_name(f.name)}`" in server, f.name
    assert "`--speculative-config`" in server and "`--no-enable-prefix-caching`" in server
    for f in dataclasses.fields(ServeConfig):
        assert f"| `{flag_name(f.name)}` |" in server, f.name


def test_the_cli_page_holds_every_command_and_option():
    group = typer.main.get_command(app)
    page = PAGES["reference/cli.md"]
    for name, command in group.commands.items():
        section = page.split(f"## `batchgen {name}`")[1].split("\n## ")[0]
        for param in command.params:
            engine_flag = name == "serve" and param.name in {f.name for f in dataclasses.fields(EngineConfig)}
            if param.param_type_name == "option" and param.name != "help" and not engine_flag:
                assert f"`{param.opts[0]}`" in section, (name, param.opts)


def cells(row: str) -> list[str]:
    """A table row split as Python-Markdown splits it: on pipes neither escaped nor inside code spans."""
    parts, current, in_code, i = [], "", False, 0
    row = row.strip().removeprefix("|").removesuffix("|")
    while i < len(row):
        char = row[i]
        if char == "\\" and not in_code:
            current += row[i:i + 2]
            i += 2
            continue
        if char == "`":
            in_code = not in_code
        if char == "|" and not in_code:
            parts.append(current)
            current = ""
        else:
            current += char
        i += 1
    return [*parts, current]


@pytest.mark.parametrize("path", sorted(PAGES))
def test_every_table_row_has_its_headers_cells(path):
    num_cells = None
    for line in PAGES[path].splitlines():
        if not line.startswith("|"):
            num_cells = None
            continue
        if num_cells is None:
            num_cells = len(cells(line))
        assert len(cells(line)) == num_cells, line
        assert not re.search(r"<[a-z/]", re.sub(r"`[^`]*`", "", line)), line  # no raw HTML outside code


def test_the_row_splitter_sees_escaped_and_code_pipes():
    """The check above would pass vacuously if every pipe split a row."""
    assert cells(r"| `a | b` | c \| d | e |") == [" `a | b` ", r" c \| d ", " e "]
