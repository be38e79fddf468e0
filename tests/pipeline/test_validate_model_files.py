"""`batchgen validate` reads the model's files as the engine does before its weights, and refuses a damaged
or hostile one with exit 2 in under a second, naming the file and the problem."""

from __future__ import annotations

import json
import shutil
import struct
import time

import pytest
import yaml
from typer.testing import CliRunner

from batchgen.cli import main as cli
from tests.engine.loader.test_gguf_layout import array_bomb
from tests.pipeline.conftest import write_parquet


def job_file(tmp_path, model: str, **input_keys) -> str:
    write_parquet(tmp_path / "in.parquet", {"id": [1, 2], "prompt": ["hi", "there"]})
    raw = {"name": "v", "model": {"path": model}, "engine": {"device": "cpu"},
           "input": {"path": "in.parquet", **input_keys}, "sampling": {"max_tokens": 4}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(raw))
    return str(tmp_path / "job.yaml")


def validate(job: str):
    start = time.monotonic()
    result = CliRunner().invoke(cli.app, ["validate", job])
    return result, time.monotonic() - start


@pytest.fixture
def model_copy(tmp_path, tiny_model):
    """A copy of the tiny HF model folder to damage."""
    return shutil.copytree(tiny_model, tmp_path / "model")


def test_the_bundled_model_and_a_tiny_folder_pass_and_say_what_was_read(tmp_path, tiny_model):
    result, _ = validate(job_file(tmp_path, "smollm2-135m-instruct"))
    assert result.exit_code == 0, result.output
    assert "GGUF header and metadata, tokenizer (49,152 tokens), chat template: renders" in result.stdout
    result, _ = validate(job_file(tmp_path, str(tiny_model)))
    assert result.exit_code == 0, result.output
    assert "config.json, safetensors headers, tokenizer" in result.stdout


@pytest.mark.parametrize("case", ["array of 2^40 items", "not a GGUF file", "bos id outside the vocabulary"])
def test_a_hostile_or_damaged_gguf_exits_2_in_under_a_second(tmp_path, smollm_path, case):
    path = tmp_path / "model.gguf"
    if case == "array of 2^40 items":
        array_bomb(path)
        words = ["tokenizer.ggml.scores", "1099511627776 items"]
    elif case == "not a GGUF file":
        path.write_bytes(b"<html>404 Not Found</html>" + b"\0" * 100)
        words = ["does not start with b'GGUF'"]
    else:
        data = bytearray(smollm_path.read_bytes())
        key = b"tokenizer.ggml.bos_token_id"
        at = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key) + 4  # past the key and its type
        data[at:at + 4] = struct.pack("<I", 10**9)
        path.write_bytes(bytes(data))
        words = ["tokenizer.ggml.bos_token_id", "1000000000"]
    job = job_file(tmp_path, str(path))
    validate(job)  # imports warm
    result, seconds = validate(job)
    assert result.exit_code == 2, result.output
    assert str(path) in result.stderr and all(w in result.stderr for w in words), result.stderr
    assert seconds < 1.0


@pytest.mark.parametrize("case", ["safetensors header past the end", "config.json not JSON",
                                  "template error"])
def test_a_damaged_hf_folder_exits_2_in_under_a_second(tmp_path, model_copy, case):
    if case == "safetensors header past the end":
        weights = model_copy / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[:8] = struct.pack("<Q", 10**12)
        weights.write_bytes(bytes(data))
        culprit, words = weights, "declares 1000000000000 bytes"
    elif case == "config.json not JSON":
        (model_copy / "config.json").write_text('{"model_type": "llama", ')
        culprit, words = model_copy / "config.json", "cannot read"
    else:
        config_path = model_copy / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        template_path = model_copy / "chat_template.jinja"
        if template_path.exists():
            template_path.write_text("{% for m in messages %}{{ m.content | nosuchfilter }}{% endfor %}")
        else:
            config["chat_template"] = "{% for m in messages %}{{ m.content | nosuchfilter }}{% endfor %}"
            config_path.write_text(json.dumps(config))
        culprit, words = model_copy, "does not render a one-message chat"
    job = job_file(tmp_path, str(model_copy))
    validate(job)
    result, seconds = validate(job)
    assert result.exit_code == 2, result.output
    assert str(culprit) in result.stderr and words in result.stderr, result.stderr
    assert seconds < 1.0 or case == "template error"  # a tokenizer load comes first there


def test_a_chat_job_on_a_model_without_a_template_is_refused_by_validate(tmp_path, model_copy):
    template_path = model_copy / "chat_template.jinja"
    template_path.unlink(missing_ok=True)
    config_path = model_copy / "tokenizer_config.json"
    config_path.write_text(json.dumps({k: v for k, v in json.loads(config_path.read_text()).items()
                                       if k != "chat_template"}))
    result, _ = validate(job_file(tmp_path, str(model_copy)))
    assert result.exit_code == 2 and "has no chat template" in result.stderr, result.output
    result, _ = validate(job_file(tmp_path, str(model_copy), apply_chat_template=False))
    assert result.exit_code == 0, result.output
