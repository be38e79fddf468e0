"""`batchgen bench --quality --model <GPTQ / AWQ folder>`: the folder's engine against its dequantized weights.

The folders are the format tests' (tests/engine/int_tiny.py: a tiny random Llama packed by the
independent packers). The bench's float32 reference holds the weights the integer layers multiply by,
so the folder's engine must agree with it everywhere; a perturbed reference must not.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
import typer
from typer.testing import CliRunner

from batchgen.bench.quality import dequantized_float_model, run_quality_bench
from batchgen.cli.bench import bench_command
from batchgen.engine.config import EngineConfig
from batchgen.engine.loader.model_loader import load_model
from tests.engine.int_tiny import write_int_checkpoint

METHOD = {"gptq-v1-act-order": "gptq", "gptq-v2-8bit": "gptq", "awq": "awq", "compressed-tensors": "compressed-tensors"}
NUM_PROMPTS, MAX_TOKENS = 8, 6


@pytest.fixture(scope="module", params=list(METHOD))
def checkpoint(request, tmp_path_factory):
    folder, hf_model = write_int_checkpoint(tmp_path_factory.mktemp("quality"), request.param)
    return request.param, folder, hf_model


def prompts() -> list[str]:
    """Raw prompts in the tiny tokenizer's words t3..t255 (t1 is EOS)."""
    rng = random.Random(7)
    return [" ".join(f"t{rng.randrange(3, 256)}" for _ in range(rng.randint(3, 10))) for _ in range(NUM_PROMPTS)]


def quality(folder, **kwargs) -> dict:
    return run_quality_bench(str(folder), prompts=prompts(), max_tokens=MAX_TOKENS, fp8_mode=[], **kwargs)


def test_the_reference_holds_the_packers_float_weights(checkpoint):
    variant, folder, hf_model = checkpoint
    reference = dequantized_float_model(load_model(EngineConfig(model=str(folder), dtype="float32")).model)
    hf = hf_model.state_dict()
    for i in range(2):
        p = f"model.layers.{i}"
        qkv = torch.cat([hf[f"{p}.self_attn.{x}_proj.weight"] for x in "qkv"])
        assert torch.equal(reference.get_submodule(f"layers.{i}.self_attn.qkv_proj").weight, qkv), variant
        assert torch.equal(reference.get_submodule(f"layers.{i}.mlp.down_proj").weight, hf[f"{p}.mlp.down_proj.weight"])
        assert type(reference.get_submodule(f"layers.{i}.mlp.gate_up_proj")) is torch.nn.Linear


def test_the_folder_engine_agrees_with_its_dequantized_weights(checkpoint):
    variant, folder, _ = checkpoint
    result = quality(folder, int_methods=["int8"])
    assert result["reference_self_consistency"] == 1.0
    entry, int8 = result["results"]
    assert (entry["quantization"], entry["weights"]["format"], entry["weights"]["origin"]) == (
        METHOD[variant], METHOD[variant], "checkpoint")
    assert entry["num_positions"] == result["num_completion_tokens"] > NUM_PROMPTS
    assert entry["top1_agreement"] == 1.0 and entry["mean_kl"] < 1e-9, entry
    assert entry["greedy_exact_match"] == 1.0
    # 4-bit codes + float16 scales and zeros per 32 columns: well under a third of float32 (8-bit: a third).
    assert entry["num_fp8_layers"] == 8 and entry["linear_bytes_ratio"] < (0.4 if "8bit" in variant else 0.3), entry
    # int8 at load starts from the same dequantized float weights: close, but not the same arithmetic.
    assert int8["quantization"] == "int8" and int8["mean_kl"] > entry["mean_kl"]


def test_a_perturbed_reference_is_told_apart(checkpoint):
    variant, folder, _ = checkpoint
    perturbed = dequantized_float_model(load_model(EngineConfig(model=str(folder), dtype="float32")).model)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, module in perturbed.named_modules():
            if name.startswith("layers.") and isinstance(module, torch.nn.Linear):
                w = module.weight
                w.add_(0.3 * w.std() * torch.randn(w.shape, generator=generator))
    entry = quality(folder, reference=perturbed)["results"][0]
    assert entry["top1_agreement"] < 1.0 and entry["mean_kl"] > 1e-3, entry


@pytest.fixture(scope="module")
def awq_folder(tmp_path_factory):
    folder, _ = write_int_checkpoint(tmp_path_factory.mktemp("quality-cli"), "awq")
    return folder


def test_a_reference_is_refused_for_a_float_model(awq_folder):
    with pytest.raises(ValueError, match="is not one"):
        run_quality_bench(str(awq_folder.parent / "awq-float"), prompts=prompts()[:1], max_tokens=1,
                          fp8_mode=[], reference=torch.nn.Linear(1, 1))


def test_bench_quality_on_the_folder_from_the_command_line(awq_folder):
    app = typer.Typer()
    app.command()(bench_command)
    result = CliRunner().invoke(app, ["--quality", "--model", str(awq_folder), "--num-requests", "3", "--json"])
    assert result.exit_code == 0, result.output
    quality_result = json.loads(result.output)["quality"]
    rows = {r["quantization"] + (f" {r['fp8_mode']}" if r["fp8_mode"] else ""): r for r in quality_result["results"]}
    assert list(rows) == ["awq", "fp8 w8a16", "fp8 w8a8"]
    assert rows["awq"]["top1_agreement"] == 1.0 and quality_result["num_prompts"] == 3
