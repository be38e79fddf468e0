"""`batchgen plan`: the classic capacity arithmetic on Mistral-7B-v0.1's shape, from a config.json alone.

The arithmetic itself is tested in tests/engine/kv/test_capacity.py; here, the command around it.
"""

from __future__ import annotations

import json

import fsspec
import pytest
from typer.testing import CliRunner

from batchgen.cli.main import app
from batchgen.cli.plan import read_target
from batchgen.pipeline.capacity_plan import make_plan
from tests.engine.model_shapes import (
    MISTRAL_7B_LOGITS_BYTES_PER_SEQ,
    MISTRAL_7B_SHAPE,
    MISTRAL_7B_STEP_ACTIVATION_BYTES,
)

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
    assert plan["activation_bytes"] == MISTRAL_7B_STEP_ACTIVATION_BYTES + 32 * MISTRAL_7B_LOGITS_BYTES_PER_SEQ
    assert plan["margin_bytes"] == plan["fragmentation_bytes"] + plan["activation_bytes"]
    assert plan["total_bytes"] == plan["total_bytes_before_margin"] + plan["margin_bytes"]

    fp8 = plan_json(str(mistral_dir), "--max-model-len", str(CONTEXT), "--concurrency", "32",
                    "--dtype", "bfloat16", "--quantization", "fp8")
    assert_near(fp8["weight_bytes"], 7.5e9)  # FP8 linear weights, embeddings and lm_head in bf16
    assert fp8["kv_bytes"] == plan["kv_bytes"]


def test_fp8_kv_cache_halves_bf16_kv_bytes_and_fits_more_requests(mistral_dir):
    args = (str(mistral_dir), "--max-model-len", str(CONTEXT), "--concurrency", "32", "--dtype", "bfloat16",
            "--memory", "141GB")
    bf16, fp8 = plan_json(*args), plan_json(*args, "--kv-cache-dtype", "fp8")
    assert (bf16["kv_cache_dtype"], fp8["kv_cache_dtype"]) == ("bfloat16", "float8_e4m3fn")
    assert fp8["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 1 == bf16["kv_bytes_per_token"] // 2
    assert fp8["weight_bytes"] == bf16["weight_bytes"]
    assert fp8["max_concurrency"] > 1.9 * bf16["max_concurrency"]
    text = CliRunner().invoke(app, ["plan", str(mistral_dir), "--kv-cache-dtype", "fp8_e5m2"]).stdout
    assert "1 bytes (float8_e5m2)" in text and "float8_e5m2 KV cache" in text


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


@pytest.mark.parametrize("name, quantization_config, expected", [
    ("plain", None, "none"),
    ("fp8", {"quant_method": "fp8", "activation_scheme": "dynamic"}, "fp8"),
    ("compressed", {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}}, "fp8"),
])
def test_remote_config_names_an_fp8_checkpoint_as_the_loader_does(name, quantization_config, expected):
    folder = f"memory://plan-test/{name}"  # only config.json is read from a remote model
    config = {**MISTRAL_7B_SHAPE, **({"quantization_config": quantization_config} if quantization_config else {})}
    with fsspec.open(f"{folder}/config.json", "w") as f:
        json.dump(config, f)
    assert plan_json(folder, "--dtype", "bfloat16")["quantization"] == expected


def test_remote_config_with_an_unsupported_quantization_exits_2():
    folder = "memory://plan-test/bnb"
    with fsspec.open(f"{folder}/config.json", "w") as f:
        json.dump({**MISTRAL_7B_SHAPE, "quantization_config": {"quant_method": "bitsandbytes"}}, f)
    result = CliRunner().invoke(app, ["plan", folder])
    assert result.exit_code == 2 and "'bitsandbytes' is not supported" in result.stderr, result.output


def test_the_plan_reports_this_cpus_isa_and_what_dtype_auto_runs_on_it(mistral_dir):
    from batchgen.engine.capabilities import auto_cpu_dtype
    from batchgen.kernels import cpu_isa

    cpu = plan_json(str(mistral_dir))["cpu"]
    assert cpu["cpu_isa"] == cpu_isa.selected_isa()
    assert cpu["has_bf16_units"] == cpu_isa.has_bf16_units(cpu["cpu_isa"])
    assert cpu["auto_dtype"] == str(auto_cpu_dtype()).removeprefix("torch.")
    text = CliRunner().invoke(app, ["plan", str(mistral_dir)]).stdout
    assert f"this CPU: ISA {cpu['cpu_isa']}, bfloat16 on BF16 units: " in text
