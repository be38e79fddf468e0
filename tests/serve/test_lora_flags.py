"""`batchgen serve --lora-modules A=path B=path` (vLLM's flag): several entries after one flag, read as
{name: path} (a job file's model.lora_modules when the flag is not given); entries that are not
name=path, a name given twice or one that is also a served model name are refused by flag before any
model loads; an adapter that cannot be read stops the server at start."""

from __future__ import annotations

import pytest
import yaml

from batchgen.cli.serve import parse_serve_flags
from batchgen.engine.config import EngineConfig
from batchgen.engine.text.chat_template import ChatTemplateOptions
from batchgen.serve.server import EXIT_BAD_USAGE, run_server
from batchgen.serve.settings import ServeConfig
from tests.conftest import TEST_ENGINE_KWARGS


def test_lora_modules_take_several_entries_after_one_flag():
    flags = parse_serve_flags(["m", "--lora-modules", "A=/x/a", "B = /x/b", "--enable-lora", "--max-lora-rank", "64"])
    serve, engine = flags.serve_config(), flags.engine_config()
    assert serve.lora_paths == {"A": "/x/a", "B": "/x/b"}
    assert list(serve.lora_paths) == ["A", "B"]  # ids 1, 2 in the order given
    assert engine.enable_lora and engine.max_lora_rank == 64
    assert parse_serve_flags(["m"]).serve_config().lora_paths == {}
    json_form = parse_serve_flags(["m", "--lora-modules", '{"name": "C", "path": "/x/c", "base_model_name": "m"}',
                                   "D=/x/d"]).serve_config()  # vLLM's JSON form, mixed with name=path
    assert json_form.lora_paths == {"C": "/x/c", "D": "/x/d"}


def test_a_job_files_adapters_are_served_unless_the_flag_replaces_them(tmp_path):
    (tmp_path / "adapters" / "a").mkdir(parents=True)  # (a missing org/name path is a Hub repo id, as model.path)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"model": {"path": "smollm2-135m-instruct", "lora_modules": {"A": "adapters/a"}},
                                   "input": {"path": "in.parquet"}}))
    flags = parse_serve_flags([str(job)])
    assert flags.serve_config().lora_paths == {"A": str(tmp_path / "adapters" / "a")}
    assert flags.engine_config().enable_lora
    assert parse_serve_flags([str(job), "--lora-modules", "B=/x/b"]).serve_config().lora_paths == {"B": "/x/b"}


@pytest.mark.parametrize("argv, message", [
    (["--lora-modules", "A"], "--lora-modules must be name=path"),
    (["--lora-modules", "=/x/a"], "--lora-modules must be name=path"),
    (["--lora-modules", '{"name": "A"}'], "--lora-modules must be name=path"),
    (["--lora-modules", '{"name": "A", '], "--lora-modules must be name=path"),
    (["--lora-modules", "A=/x/a", "A=/x/b"], "--lora-modules must name each adapter once"),
    (["--served-model-name", "base", "--lora-modules", "base=/x/a"], "must not reuse a --served-model-name"),
])
def test_a_bad_lora_module_names_the_flag(argv, message):
    with pytest.raises(ValueError, match=message):
        parse_serve_flags(["m", *argv]).serve_config()


def test_an_adapter_that_cannot_be_read_stops_the_server_at_start(smollm_hf_folder, tmp_path, capsys):
    config = EngineConfig(model=str(smollm_hf_folder), **TEST_ENGINE_KWARGS)  # enable_lora: turned on by the flag
    serve = ServeConfig(lora_modules=(f"A={tmp_path / 'missing'}",))
    assert run_server(config, serve, ChatTemplateOptions()) == EXIT_BAD_USAGE
    err = capsys.readouterr().err
    assert "--lora-modules" in err and "'A'" in err
