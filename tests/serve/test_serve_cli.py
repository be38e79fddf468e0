"""`batchgen serve`'s flags: one per EngineConfig field under vLLM's names, a job file's sections, and
bad values named by flag (no model is loaded here)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from batchgen.cli.main import app
from batchgen.cli.serve import parse_serve_flags, serve_command
from batchgen.config_docs import field_docs
from batchgen.engine.config import EngineConfig
from batchgen.serve.settings import ServeConfig

JOBS = Path(__file__).resolve().parents[2] / "jobs"


def _config(*argv: str) -> EngineConfig:
    return parse_serve_flags(list(argv)).engine_config()


def _flags(config_class: type = EngineConfig) -> dict[str, list[str]]:
    return {p.name: [*p.opts, *p.secondary_opts] for p in serve_command(config_class).params}


def test_every_engine_field_is_a_flag_and_a_new_field_becomes_one():
    flags = _flags()
    for f in dataclasses.fields(EngineConfig):
        if f.name != "model":
            assert f.name in flags
    assert flags["max_num_seqs"] == ["--max-num-seqs"]
    assert flags["enable_prefix_caching"] == ["--enable-prefix-caching", "--no-enable-prefix-caching"]

    @dataclasses.dataclass(frozen=True)
    class Grown(EngineConfig):
        new_knob: int = 3

    grown = _flags(Grown)
    assert grown["new_knob"] == ["--new-knob"]
    assert parse_serve_flags(["m", "--new-knob", "5"], Grown).engine_config().new_knob == 5


def test_flags_become_engine_settings_with_their_types():
    config = _config("smollm2-135m-instruct", "--max-num-seqs", "8", "--no-enable-prefix-caching",
                     "--kv-cache-memory", "256MiB", "--max-model-len", "1024", "--dtype", "float32")
    assert (config.model, config.max_num_seqs, config.enable_prefix_caching, config.kv_cache_memory,
            config.max_model_len, config.dtype) == ("smollm2-135m-instruct", 8, False, "256MiB", 1024, "float32")
    assert _config("smollm2-135m-instruct") == EngineConfig(model="smollm2-135m-instruct")
    for name in ("int8", "int4", "gptq", "awq", "compressed-tensors", "gguf"):  # the job key's names
        assert _config("smollm2-135m-instruct", "--quantization", name).quantization == name


def test_vllms_tool_and_reasoning_flags():
    flags = parse_serve_flags(["smollm2-135m-instruct", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                               "--reasoning-parser", "qwen3"])
    config = flags.engine_config()
    assert (config.tool_call_parser, config.reasoning_parser) == ("hermes", "qwen3")
    assert _flags()["enable_auto_tool_choice"][0] == "--enable-auto-tool-choice"
    assert flags.server["enable_auto_tool_choice"] is True


def test_a_job_file_gives_its_model_and_engine_sections_and_flags_override_them():
    config = _config(str(JOBS / "nightly_eval.yaml"))  # model: max_model_len 2048; engine: kv_cache_memory 128MiB
    assert config.max_model_len == 2048 and config.kv_cache_memory == "128MiB"
    assert config.model == "smollm2-135m-instruct"
    assert _config(str(JOBS / "nightly_eval.yaml"), "--max-model-len", "512").max_model_len == 512
    assert _config(str(JOBS / "nightly_eval.yaml"), "--kv-cache-memory", "64MiB").kv_cache_memory == "64MiB"
    # A job's generation_config default (vllm) is a job's: served, unset request fields take the model's.
    config = _config(str(JOBS / "quickstart.yaml"))
    assert config.generation_config == "auto"
    assert _config(str(JOBS / "quickstart.yaml"), "--generation-config", "vllm").generation_config == "vllm"


@pytest.mark.parametrize("argv, message", [
    (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
    (["--max-num-seqs", "many"], "--max-num-seqs: cannot read 'many'"),
    (["--dtype", "float64"], "--dtype must be one of"),
    (["--quantization", "int3"], "--quantization must be one of"),
    (["--tool-call-parser", "json"], "--tool-call-parser must be null or one of hermes, llama3_json, mistral"),
    (["--reasoning-parser", "r1"], "--reasoning-parser must be null or one of deepseek_r1, qwen3"),
])
def test_a_bad_value_names_its_flag(argv, message):
    with pytest.raises(ValueError, match=message):
        _config("smollm2-135m-instruct", *argv)


def test_serve_help_shows_the_engine_fields_docstrings():
    result = CliRunner().invoke(app, ["serve", "--help"], terminal_width=100)
    assert result.exit_code == 0, result.output
    text = " ".join(re.sub(r"[│╭╮╰╯─]", " ", result.output).split())
    docs = field_docs(EngineConfig)
    for name in ("max_num_seqs", "enable_prefix_caching", "gpu_memory_utilization"):
        assert " ".join(docs[name].split()) in text, name
    assert "--max-num-seqs" in text and "--no-enable-prefix-caching" in text
    assert " ".join(field_docs(ServeConfig)["shutdown_timeout"].split()) in text
