"""Block-scaled FP8 checkpoints (DeepSeek-V3 / Qwen3-*-FP8 layout: quantization_config quant_method fp8 with
weight_block_size; per linear layer a float8_e4m3fn `weight` and a float32 `weight_scale_inv` per block)
load dequantized, experts included.

A tiny random Qwen3-MoE (a dense layer among sparse ones) saved by transformers (per-expert tensors), every
attention, dense-MLP and expert projection quantized in 32 x 48 blocks (partial edge blocks: 64, 32 and 96
input channels), the router, norms, embeddings and lm_head left in float32 (as the published checkpoints
leave them). HF runs the same weights dequantized by transformers' own fine-grained FP8 dequantizer.
Shown: prompt log-probabilities within 1e-4 of HF's, greedy tokens equal to HF's, and the FP8 folder giving
exactly the float folder's log-probabilities; a missing scale is refused by name; tp=2 over gloo (each
weight dequantized whole, then split) gives one process's greedy tokens.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from batchgen.engine import LLM, SamplingParams
from tests.engine.helpers import run_requests
from tests.engine.models.test_moe import ATTENTION, FAMILIES, SETTINGS
from tests.engine.models.test_registry import randomize_weights

BLOCK = [32, 48]
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NUM_TOKENS = 16


def quantize_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> float8_e4m3fn codes and (ceil(N / 32), ceil(K / 48)) float32 scales (amax / 448)."""
    rows, cols = weight.shape
    scales = torch.empty(-(-rows // BLOCK[0]), -(-cols // BLOCK[1]))
    codes = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            block = weight[i * BLOCK[0]:(i + 1) * BLOCK[0], j * BLOCK[1]:(j + 1) * BLOCK[1]]
            scales[i, j] = block.abs().max() / 448.0
            codes[i * BLOCK[0]:(i + 1) * BLOCK[0], j * BLOCK[1]:(j + 1) * BLOCK[1]] = (block / scales[i, j]).to(
                torch.float8_e4m3fn)
    return codes, scales


@pytest.fixture(scope="module")
def checkpoints(hf_tokenizer, tmp_path_factory):
    """{"fp8": the block-scaled folder, "float": the same weights dequantized by transformers}, and HF's model
    on the dequantized weights."""
    import transformers
    from safetensors.torch import load_file, save_file
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    config = transformers.Qwen3MoeConfig(vocab_size=len(hf_tokenizer), **ATTENTION, **FAMILIES["Qwen3MoeForCausalLM"])
    config._attn_implementation = "eager"
    torch.manual_seed(4)
    model = randomize_weights(transformers.Qwen3MoeForCausalLM(config).float().eval())
    root = tmp_path_factory.mktemp("qwen3-moe-fp8-block")
    model.save_pretrained(root / "float")
    hf_tokenizer.save_pretrained(root / "float")
    shutil.copytree(root / "float", root / "fp8")
    tensors = load_file(str(root / "float" / "model.safetensors"))
    fp8, dequantized = {}, {}
    for name, tensor in tensors.items():
        if name.endswith(".weight") and name.split(".")[-2] in QUANTIZED:
            codes, scales = quantize_blocks(tensor.float())
            fp8[name], fp8[name + "_scale_inv"] = codes, scales
            dequantized[name] = _dequantize_fp8_weight(codes, scales, BLOCK, torch.float32)
        else:
            fp8[name] = dequantized[name] = tensor
    assert sum(name.endswith("_scale_inv") and ".experts." in name for name in fp8) == 2 * 16 * 3  # 2 sparse layers
    save_file(fp8, str(root / "fp8" / "model.safetensors"))
    save_file(dequantized, str(root / "float" / "model.safetensors"))
    raw = json.loads((root / "fp8" / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": BLOCK}
    (root / "fp8" / "config.json").write_text(json.dumps(raw))
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(root / "float", attn_implementation="eager").float().eval()
    return {"fp8": root / "fp8", "float": root / "float"}, hf


@torch.no_grad()
def test_a_block_scaled_fp8_moe_checkpoint_equals_hf_on_its_dequantized_weights(checkpoints, hf_tokenizer):
    folders, hf = checkpoints
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, len(hf_tokenizer), (n,), generator=gen).tolist() for n in (8, 27, 45)]
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, prompt_logprobs=0)
    runs = {}
    for kind, folder in folders.items():
        outputs = run_requests(LLM(str(folder), **SETTINGS).engine, {f"p{i}": (p, params) for i, p in enumerate(prompts)})
        runs[kind] = [[position[t].logprob for position, t in zip(outputs[f"p{i}"].prompt_logprobs[1:], p[1:])]
                      for i, p in enumerate(prompts)]
        if kind == "fp8":
            fp8_outputs = outputs
    assert runs["fp8"] == runs["float"]  # dequantized at load: the same floats as the float folder
    for i, ids in enumerate(prompts):
        want = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
        want = want.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
        assert (torch.tensor(runs["fp8"][i]) - want).abs().max().item() <= 1e-4, f"prompt {i}"
        prompt = torch.tensor([ids])
        greedy = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, use_cache=False,
                             max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS, pad_token_id=0)
        assert fp8_outputs[f"p{i}"].outputs[0].token_ids == greedy[0, len(ids):].tolist(), f"prompt {i}"


def test_an_fp8_weight_without_its_block_scales_is_refused_by_name(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    folders, _ = checkpoints
    folder = shutil.copytree(folders["fp8"], tmp_path / "ckpt")
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.0.mlp.experts.5.up_proj.weight_scale_inv"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.experts\.5\.up_proj\.weight \(no weight_scale_inv\)"):
        LLM(str(folder), **SETTINGS)


@pytest.mark.subprocess
@torch.no_grad()
def test_tp2_on_a_block_scaled_fp8_checkpoint_equals_one_process(checkpoints, hf_tokenizer):
    folders, _ = checkpoints
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, len(hf_tokenizer), (n,), generator=gen).tolist() for n in (9, 30, 52)]
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    requests = {f"p{i}": (p, params) for i, p in enumerate(prompts)}
    expected = run_requests(LLM(str(folders["fp8"]), **SETTINGS).engine, requests)
    threads = torch.get_num_threads()
    tp = LLM(str(folders["fp8"]), tensor_parallel_size=2, **SETTINGS)
    try:
        got = run_requests(tp.engine, requests)
    finally:
        tp.engine.shutdown()
        torch.set_num_threads(threads)
    assert {k: v.outputs[0].token_ids for k, v in got.items()} == {k: v.outputs[0].token_ids for k, v in expected.items()}


def test_quantization_fp8_requantizes_the_dequantized_checkpoint_per_channel(checkpoints):
    """`model.quantization: fp8` on a block-scaled checkpoint: its weights arrive dequantized, so the at-load
    FP8 quantizer stores the decoder's linear layers per channel and the routed experts per (expert, channel),
    and the planner's weight bytes for it are the engine's."""
    from batchgen.engine.kv.capacity import weight_bytes
    from batchgen.engine.quant.fp8_linear import Fp8Linear

    folders, _ = checkpoints
    llm = LLM(str(folders["fp8"]), quantization="fp8", **SETTINGS)
    model = llm.engine.runner.model
    assert isinstance(model.layers[0].self_attn.qkv_proj, Fp8Linear)
    assert model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert llm.engine.weight_bytes == weight_bytes(llm.engine.model_cfg, torch.float32, "fp8")
    out = run_requests(llm.engine, {"p": (list(range(5, 40)), SamplingParams(temperature=0, max_tokens=4))})["p"]
    assert len(out.outputs[0].token_ids) == 4


@torch.no_grad()
def test_fp8_experts_at_load_stay_close_to_the_float_experts(checkpoints, hf_tokenizer, monkeypatch):
    """`quantization: fp8` quantizes the routed experts too (E4M3, a float32 scale per (expert, output
    channel), weight-only): the engine holds them so (about a quarter of float32's bytes) and plans them so.
    The experts alone quantized in place (quant/fp8_experts.py) on a float engine: every weight within
    E4M3's rounding of its float value (2^-4 relative, or half the smallest subnormal step), the prompt
    log-probabilities those of float experts holding the dequantized values (the FP8 path computes
    nothing else), and within a small margin of the float model's (this random model amplifies: 3
    layers of N(0, 0.3) weights, log-probabilities down to -20; measured mean 0.12, max 0.51).
    """
    from batchgen.engine.kv.capacity import weight_bytes
    from batchgen.engine.quant.fp8_experts import quantize_experts_fp8

    folders, _ = checkpoints
    llm = LLM(str(folders["float"]), quantization="fp8", **SETTINGS)
    experts = [layer.mlp.experts for layer in llm.engine.runner.model.layers if hasattr(layer.mlp, "experts")]
    assert len(experts) == 2 and all(e.is_fp8 and e.down_proj.dtype == torch.float8_e4m3fn for e in experts)
    held = sum(t.numel() * t.element_size() for e in experts
               for t in (e.gate_up_proj, e.down_proj, e.gate_up_proj_scale, e.down_proj_scale))
    assert held < 0.3 * sum(4 * (e.gate_up_proj.numel() + e.down_proj.numel()) for e in experts)
    assert llm.engine.weight_bytes == weight_bytes(llm.engine.model_cfg, torch.float32, "fp8")

    prompts = [torch.randint(3, len(hf_tokenizer), (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (21, 40, 57)]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    from batchgen.engine import capabilities

    monkeypatch.setattr(capabilities, "can_pack", lambda device, dtype: False)  # experts as (E, ...) tensors
    engine = LLM(str(folders["float"]), enable_prefix_caching=False, **SETTINGS).engine

    def logprobs(tag: str) -> torch.Tensor:
        outputs = run_requests(engine, {f"{tag}{i}": (ids, params) for i, ids in enumerate(prompts)})
        return torch.cat([torch.tensor([p[t].logprob for p, t in zip(outputs[f"{tag}{i}"].prompt_logprobs[1:], ids[1:])])
                          for i, ids in enumerate(prompts)])

    before = logprobs("float")
    experts = [layer.mlp.experts for layer in engine.runner.model.layers if hasattr(layer.mlp, "experts")]
    originals = [(e.gate_up_proj.detach().clone(), e.down_proj.detach().clone()) for e in experts]
    assert quantize_experts_fp8(engine.runner.model)[0] == 2
    quantized = logprobs("fp8")
    for e, weights in zip(experts, originals):
        for name, original in zip(("gate_up_proj", "down_proj"), weights):
            scales = getattr(e, f"{name}_scale")
            dequantized = getattr(e, name).float() * scales[:, :, None]
            bound = torch.maximum(original.abs() * 2 ** -4, scales[:, :, None] * 2 ** -10)
            assert ((dequantized - original).abs() <= bound).all(), name
            setattr(e, name, torch.nn.Parameter(dequantized, requires_grad=False))  # float experts, FP8 values
            setattr(e, f"{name}_scale", None)
    assert not any(e.is_fp8 for e in experts)
    torch.testing.assert_close(logprobs("dequantized"), quantized, rtol=0, atol=1e-5)
    differences = (quantized - before).abs()
    assert 0 < differences.mean() < 0.25 and differences.max() < 1.0
