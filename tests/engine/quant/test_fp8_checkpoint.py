"""FP8 checkpoints in the AutoFP8 / llm-compressor layout: loaded as stored, never re-quantized."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.config import EngineConfig
from batchgen.engine.kv.capacity import weight_bytes
from batchgen.engine.loader.model_loader import load_model
from batchgen.engine.quant import fp8_checkpoint
from batchgen.engine.quant.calibrate.sequence_runner import SequenceRunner, teacher_forced_logits
from batchgen.engine.quant.fp8_linear import Fp8Linear
from batchgen.engine.quant.fp8_writer import write_fp8_checkpoint
from tests.engine.fp8_tiny import calibrate_input_scales, write_tiny_llama

ENGINE = dict(dtype="float32", device="cpu", kv_cache_memory="16MiB", max_model_len=256)
PROMPTS = [[5, 17, 33, 9, 200, 41], [7, 7, 120, 64]]
COMPLETIONS = [[88, 3, 150, 12, 19], [250, 14, 6]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """The float checkpoint and FP8 copies of it: per channel, per tensor, with static input scales."""
    root = tmp_path_factory.mktemp("fp8ckpt")
    src, hf_model = write_tiny_llama(root / "float")
    scales = calibrate_input_scales(hf_model, torch.tensor([sum(PROMPTS + COMPLETIONS, [])]))
    scales["model.layers.0.self_attn.k_proj"] *= 1.5  # q/k/v scales differ: the fused layer takes their max
    return {"float": src,
            "channel": write_fp8_checkpoint(src, root / "channel", "channel"),
            "tensor": write_fp8_checkpoint(src, root / "tensor", "tensor"),
            "static": write_fp8_checkpoint(src, root / "static", "tensor", input_scales=scales),
            "input_scales": scales}


def load(path: Path, **kwargs):
    return load_model(EngineConfig(model=str(path), **{**ENGINE, **kwargs})).model


def logits(model) -> torch.Tensor:
    return torch.cat(teacher_forced_logits(model, PROMPTS, COMPLETIONS))  # (8, V)


def fp8_layers(model) -> dict[str, Fp8Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Fp8Linear)}


def test_per_channel_checkpoint_equals_quantizing_at_load_without_requantizing(tiny, monkeypatch):
    at_load = load(tiny["float"], quantization="fp8")

    def no_requantizing(*args, **kwargs):
        raise AssertionError("an FP8 checkpoint must not be quantized again")

    monkeypatch.setattr(Fp8Linear, "from_linear", no_requantizing)
    stored = load(tiny["channel"])  # quantization: auto -- the checkpoint itself says FP8
    layers_at_load, layers_stored = fp8_layers(at_load), fp8_layers(stored)
    assert sorted(layers_stored) == sorted(layers_at_load) and len(layers_stored) == 8  # 2 layers x 4; lm_head not
    for name, layer in layers_stored.items():
        # Per-row scales do not care whether q/k/v are fused: the same bits either way.
        assert torch.equal(layer.weight.view(torch.uint8), layers_at_load[name].weight.view(torch.uint8)), name
        assert torch.equal(layer.weight_scale, layers_at_load[name].weight_scale), name
    assert torch.equal(logits(stored), logits(at_load))


def test_per_tensor_checkpoint_gives_the_logits_of_its_dequantized_weights(tiny, tmp_path):
    stored = load(tiny["tensor"])
    qkv, o_proj = stored.layers[0].self_attn.qkv_proj, stored.layers[0].self_attn.o_proj
    assert o_proj.is_per_tensor  # unfused: the checkpoint's one scale, kept as stored
    # Fused q/k/v: each part's own per-tensor scale fills its rows of a per-channel scale.
    tensors = load_file(str(tiny["tensor"] / "model.safetensors"))
    parts = [tensors[f"model.layers.0.self_attn.{p}_proj.weight_scale"].item() for p in "qkv"]
    assert len(set(parts)) == 3
    assert torch.equal(qkv.weight_scale, torch.tensor(parts).repeat_interleave(torch.tensor([64, 32, 32])))

    # The float model holding exactly q * scale must produce the same logits.
    dequantized = tmp_path / "dequantized"
    shutil.copytree(tiny["float"], dequantized)
    float_tensors = {n: t for n, t in tensors.items() if not n.endswith("_scale")}
    for name in list(float_tensors):
        if name + "_scale" in tensors:
            float_tensors[name] = float_tensors[name].float() * tensors[name + "_scale"].float()
    save_file(float_tensors, str(dequantized / "model.safetensors"))
    torch.testing.assert_close(logits(stored), logits(load(dequantized)), rtol=1e-5, atol=1e-5)


def test_static_input_scales_are_loaded_and_used_by_w8a8(tiny):
    w8a8 = load(tiny["static"], fp8_mode="w8a8")
    scales = tiny["input_scales"]
    qkv = w8a8.layers[0].self_attn.qkv_proj
    expected = max(scales[f"model.layers.0.self_attn.{p}_proj"] for p in "qkv")
    assert qkv.mode == "w8a8" and qkv.input_scale.item() == pytest.approx(expected, rel=1e-6)
    assert w8a8.layers[1].mlp.down_proj.input_scale.item() == pytest.approx(scales["model.layers.1.mlp.down_proj"],
                                                                             rel=1e-6)
    reference = logits(load(tiny["float"]))
    static, weight_only = logits(w8a8), logits(load(tiny["static"], fp8_mode="w8a16"))
    dynamic = logits(load(tiny["tensor"], fp8_mode="w8a8"))  # same FP8 weights, per-token activation scales
    assert not torch.equal(static, weight_only) and not torch.equal(static, dynamic)

    def rel_error(test: torch.Tensor) -> float:
        return ((test - reference).norm() / reference.norm()).item()

    # This random tiny model amplifies rounding (weight-only already moves its logits ~7%). Rounding the
    # activations adds an independent error of similar size, in quadrature ~sqrt(2)x; a misapplied
    # static scale (saturation, or no scaling) would be far past 2x. Measured: 0.067 weight-only, 0.098 static.
    assert rel_error(static) < 2 * rel_error(weight_only)


def test_llm_runs_an_fp8_checkpoint_end_to_end(tiny):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    stored = LLM(str(tiny["channel"]), **ENGINE)
    at_load = LLM(str(tiny["float"]), quantization="fp8", **ENGINE)
    float_llm = LLM(str(tiny["float"]), **ENGINE)
    outputs = [llm.generate(["t5 t17 t33 t9", "t7 t7 t120"], params) for llm in (stored, at_load)]
    assert [o.outputs[0].token_ids for o in outputs[0]] == [o.outputs[0].token_ids for o in outputs[1]]
    assert len(outputs[0][0].outputs[0].token_ids) == 12
    assert stored.engine.weight_bytes == at_load.engine.weight_bytes < float_llm.engine.weight_bytes
    # The planner's arithmetic gives the same bytes as the storage measurement, FP8 lm_head included.
    cfg = stored.engine.model_cfg
    assert weight_bytes(cfg, torch.float32) == float_llm.engine.weight_bytes
    assert weight_bytes(cfg, torch.float32, "fp8") == stored.engine.weight_bytes
    lm_head_too = LLM(str(tiny["float"]), quantization="fp8", quantize_lm_head=True, **ENGINE)
    assert isinstance(lm_head_too.engine.runner.model.lm_head, Fp8Linear)
    assert weight_bytes(cfg, torch.float32, "fp8", quantize_lm_head=True) == lm_head_too.engine.weight_bytes


def write_config(folder: Path, quantization_config: dict) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("quantization_config, message", [
    # block-scaled FP8 loads dequantized (quant/fp8_block.py); a per-channel folder declared so is refused
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
     "declares FP8 in blocks .weight_block_size., which hold weight_scale_inv tensors"),
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "weights": {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]}}}},
     "block-wise"),
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "weights": {"num_bits": 2, "type": "int", "strategy": "group", "group_size": 128}}},
      "format": "pack-quantized"}, "only 4- or 8-bit int"),
    ({"quant_method": "gptq", "bits": 3}, "GPTQ bits 3 are not supported"),
    ({"quant_method": "bitsandbytes"}, "not supported"),
])
def test_unsupported_quantization_configs_are_refused(tiny, tmp_path, quantization_config, message):
    folder = shutil.copytree(tiny["channel"], tmp_path / "ckpt")
    write_config(folder, quantization_config)
    with pytest.raises(ValueError, match=message):
        load(folder)


def test_blockwise_scale_tensors_are_refused_even_without_a_block_size_in_the_config(tiny, tmp_path):
    folder = shutil.copytree(tiny["channel"], tmp_path / "ckpt")
    tensors = load_file(str(folder / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight_scale"
    tensors[name + "_inv"] = torch.ones(1, 1)
    del tensors[name]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="block-wise FP8 checkpoints .weight_scale_inv"):
        load(folder)


def test_a_missing_weight_scale_is_an_error(tiny, tmp_path):
    folder = shutil.copytree(tiny["channel"], tmp_path / "ckpt")
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight_scale"]  # q and v still mark the layer as FP8
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="missing weight_scale for .part of. layers.1.self_attn.qkv_proj"):
        load(folder)


def test_compressed_tensors_fp8_config_is_accepted(tiny, tmp_path):
    folder = shutil.copytree(tiny["channel"], tmp_path / "ckpt")
    write_config(folder, {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                          "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                              "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}}}})
    assert fp8_checkpoint.read_fp8_quant_config(folder)["quant_method"] == "compressed-tensors"
    assert len(fp8_layers(load(folder))) == 8


def test_kv_cache_scales_are_read_and_used_only_by_an_fp8_kv_cache(tiny, tmp_path):
    folder = shutil.copytree(tiny["channel"], tmp_path / "ckpt")
    tensors = load_file(str(folder / "model.safetensors"))
    # Both spellings AutoFP8 / llm-compressor have used: layer 0 k_proj/v_proj output_scale, layer 1 k_scale/v_scale.
    tensors["model.layers.0.self_attn.k_proj.output_scale"] = torch.tensor(0.25)
    tensors["model.layers.0.self_attn.v_proj.output_scale"] = torch.tensor(0.125)
    tensors["model.layers.1.self_attn.k_scale"] = torch.tensor(0.5)
    tensors["model.layers.1.self_attn.v_scale"] = torch.tensor(2.0)
    save_file(tensors, str(folder / "model.safetensors"))
    model = load(folder)
    assert model.kv_cache_scales == {0: {"k": 0.25, "v": 0.125}, 1: {"k": 0.5, "v": 2.0}}
    assert torch.equal(logits(model), logits(load(tiny["channel"])))  # a float cache ignores them
    runner = SequenceRunner(model, 1, 8, kv_cache_dtype=torch.float8_e4m3fn)
    assert [(c.k_scale.item(), c.v_scale.item()) for c in runner.kv_caches] == [(0.25, 0.125), (0.5, 2.0)]
