"""`batchgen plan`: the classic capacity arithmetic on Mistral-7B-v0.1's shape, from a config.json alone."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from batchgen.engine import capacity
from batchgen.engine.capacity import num_kv_blocks, plan_capacity
from batchgen.engine.config import parse_memory_size
from batchgen.pipeline.cli import app
from batchgen.pipeline.plan import make_plan, read_model, read_target

MISTRAL_7B_SHAPE = {
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 32000, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
CONTEXT = 32768


@pytest.fixture
def mistral_dir(tmp_path):
    folder = tmp_path / "mistral-7b-shape"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(MISTRAL_7B_SHAPE))  # no weights, no tokenizer
    return folder


def plan_json(*args: str) -> dict:
    result = CliRunner().invoke(app, ["plan", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def assert_near(value: float, expected: float, rel: float = 0.03) -> None:
    assert abs(value - expected) <= rel * expected, (value, expected)


def test_mistral_7b_worked_example(mistral_dir):
    plan = plan_json(str(mistral_dir), "--max-model-len", str(CONTEXT), "--concurrency", "32",
                     "--dtype", "bfloat16")
    assert plan["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 2
    assert_near(plan["kv_bytes_per_request"], 4.29e9)  # 2 x 32 x 8 x 128 x 32768 x 2 bytes
    assert_near(plan["weight_bytes"], 14.5e9)
    assert_near(plan["kv_bytes"], 137.4e9)  # 32 x 4.29 GB
    assert_near(plan["total_bytes_before_margin"], 152e9)  # weights + KV of 32 requests
    # The margin is shown separately and adds up.
    assert plan["fragmentation_bytes"] == int(0.10 * plan["kv_bytes"])
    assert plan["margin_bytes"] == plan["fragmentation_bytes"] + plan["activation_bytes"] > 0
    assert plan["total_bytes"] == plan["total_bytes_before_margin"] + plan["margin_bytes"]

    fp8 = plan_json(str(mistral_dir), "--max-model-len", str(CONTEXT), "--concurrency", "32",
                    "--dtype", "bfloat16", "--quantization", "fp8")
    assert_near(fp8["weight_bytes"], 7.5e9)  # FP8 linear weights, embeddings and lm_head in bf16
    assert fp8["kv_bytes"] == plan["kv_bytes"]


def test_text_output_uses_decimal_gb(mistral_dir):
    result = CliRunner().invoke(app, ["plan", str(mistral_dir), "--concurrency", "32", "--memory", "141GB"])
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "decimal GB" in text
    for figure in ("14.48 GB", "4.29 GB", "137.44 GB", "151.92 GB", "fits in 141.00 GB"):
        assert figure in text, figure


def test_fit_count_is_the_largest_concurrency_that_fits(mistral_dir):
    target = read_target(str(mistral_dir))
    memory = 141 * 10**9
    fits = make_plan(target, concurrency=1, dtype="bfloat16", memory="141GB").max_concurrency
    assert fits == 26
    assert make_plan(target, concurrency=fits, dtype="bfloat16").total_bytes <= memory
    assert make_plan(target, concurrency=fits + 1, dtype="bfloat16").total_bytes > memory


def test_job_file_settings_and_overrides(mistral_dir, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(
        f"name: plan-me\nmodel:\n  path: {mistral_dir}\n  dtype: bfloat16\n  quantization: fp8\n"
        "  max_model_len: 8192\nengine:\n  max_num_seqs: 16\n"
        "input:\n  path: prompts.parquet\n  prompt_column: prompt\n")
    plan = plan_json(str(job))
    assert (plan["dtype"], plan["quantization"], plan["max_model_len"], plan["concurrency"]) == (
        "bfloat16", "fp8", 8192, 16)
    assert plan["kv_bytes_per_request"] == 131072 * 8192
    override = plan_json(str(job), "--max-model-len", "4096", "--quantization", "none", "--concurrency", "2")
    assert (override["max_model_len"], override["quantization"], override["concurrency"]) == (4096, "none", 2)


@pytest.mark.parametrize("args", [
    ["/no/such/model"], ["{model}", "--memory", "0.5"], ["{model}", "--dtype", "int4"]])
def test_bad_input_exits_2(mistral_dir, args):
    result = CliRunner().invoke(app, ["plan", *[a.format(model=mistral_dir) for a in args]])
    assert result.exit_code == 2, result.output


def test_pool_sizing_and_plan_share_kv_bytes_per_token(mistral_dir, monkeypatch):
    cfg, _ = read_model(str(mistral_dir))
    # Swap the one function: the pool's block count and the plan's KV figures must both follow it.
    monkeypatch.setattr(capacity, "kv_bytes_per_token", lambda cfg, dtype: 1000)
    assert num_kv_blocks(10**9, cfg, torch.bfloat16, 16) == 10**9 // (1000 * 16)
    assert plan_capacity(cfg, torch.bfloat16, 4096).kv_bytes_per_request == 1000 * 4096


def test_engine_pool_matches_plan(llm):
    """The loaded engine's pool (a 256 MiB budget in the test config) and weights, planned from GGUF."""
    engine = llm.engine
    cfg, _ = read_model("smollm2-135m-instruct")
    plan = plan_capacity(cfg, engine.config.torch_dtype, engine.max_model_len)
    assert engine.kv_bytes_per_token == plan.kv_bytes_per_token
    budget = parse_memory_size(engine.config.kv_cache_memory)
    assert engine.num_kv_blocks == budget // (plan.kv_bytes_per_token * engine.config.block_size)
    assert engine.weight_bytes == plan.weight_bytes
