"""Float LoRA adapters over quantized bases, as vLLM allows: the bundled GGUF with its Q4_1 blocks kept
(quantization: gguf), and the HF folder quantized at load to int8 and to FP8. Each equals peft with the
adapter applied over the base's dequantized weights (the weights the engine multiplies by): greedy
tokens (8) for A, B and the base mixed, prompt log-probabilities within 1e-4. An adapter asked to merge
into kept GGUF blocks runs unmerged instead (same outputs); merged before int8 quantization, the
quantized weights are those of the merged model."""

from __future__ import annotations

import copy

import pytest
import torch

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.quant.fp8_linear import Fp8Linear
from batchgen.engine.quant.fp8_tensor import dequantize_fp8
from batchgen.engine.quant.int_linear import IntLinear
from tests.conftest import TEST_ENGINE_KWARGS
from tests.lora_adapters import peft_greedy, peft_prompt_logprobs

NUM_TOKENS = 8
ROWS = [0, 1, 2]
ADAPTER_OF = ["A", "B", None]
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS)
LORA = dict(enable_lora=True, max_loras=2, max_lora_rank=16)
# The HF module names of each engine module (fused ones split by rows in this order).
HF_PARTS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            "self_attn.o_proj": ("self_attn.o_proj",), "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
            "mlp.down_proj": ("mlp.down_proj",)}


def dense_weight(layer) -> torch.Tensor:
    """(out, in) float32: what a (possibly LoRA-wrapped) quantized layer multiplies by."""
    layer = getattr(layer, "base", layer)
    if isinstance(layer, IntLinear):
        return layer.dequantized_weight()
    if isinstance(layer, Fp8Linear):
        return dequantize_fp8(layer.weight, layer.weight_scale)
    return layer.weight.float()


def peft_over(peft_model, engine_model):
    """A copy of peft's model (adapters A-D) whose base weights are the engine's dequantized ones."""
    reference = copy.deepcopy(peft_model)
    modules = dict(reference.base_model.model.model.named_modules())
    for i, layer in enumerate(engine_model.layers):
        for ours, theirs in HF_PARTS.items():
            weight = dense_weight(layer.get_submodule(ours))
            sizes = [getattr(modules[f"layers.{i}.{name}"], "base_layer", modules[f"layers.{i}.{name}"]).out_features
                     for name in theirs]
            for name, part in zip(theirs, weight.split(sizes)):
                target = modules[f"layers.{i}.{name}"]
                getattr(target, "base_layer", target).weight.data.copy_(part)
    return reference.eval()


def check_equals_peft(llm, reference, prompt_ids, requests, hf_tokenizer, adapter_of=ADAPTER_OF):
    prompts = [prompt_ids[i] for i in ROWS]
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], GREEDY,
                           lora_request=[requests[n] if n else None for n in adapter_of])
    for adapter in dict.fromkeys(adapter_of):
        rows = [i for i, name in enumerate(adapter_of) if name == adapter]
        expected = peft_greedy(reference, adapter, [prompts[i] for i in rows], NUM_TOKENS, llm.engine.eos_token_ids,
                               hf_tokenizer.pad_token_id)
        assert [outputs[i].outputs[0].token_ids for i in rows] == expected, f"adapter {adapter}"
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    for i in (0,):
        out = llm.generate([{"prompt_token_ids": prompts[i]}], params,
                           lora_request=requests[adapter_of[i]] if adapter_of[i] else None)[0]
        ours = torch.tensor([p[t].logprob for p, t in zip(out.prompt_logprobs[1:], prompts[i][1:])])
        expected = torch.tensor(peft_prompt_logprobs(reference, adapter_of[i], prompts[i]))
        assert (ours - expected).abs().max().item() <= 1e-4, f"prompt {i}"


@pytest.fixture(scope="module")
def gguf_lora_llm():
    """The bundled GGUF with its Q4_1 blocks kept, LoRA layers over them."""
    return LLM("smollm2-135m-instruct", quantization="gguf", **LORA, **TEST_ENGINE_KWARGS)


@pytest.mark.parametrize("quantization", ["gguf", "int8", "fp8"])
def test_adapters_over_a_quantized_base_equal_peft_over_its_dequantized_weights(
        quantization, lora_adapters, lora_requests, prompt_ids, smollm_hf_folder, hf_tokenizer, request):
    peft_model, _ = lora_adapters
    # gguf: the bundled file, its blocks kept; int8 / fp8: the HF folder quantized at load (int8 rounded to
    # nearest: no calibration passes, how the base was quantized is not what is tested)
    llm = request.getfixturevalue("gguf_lora_llm") if quantization == "gguf" else \
        LLM(str(smollm_hf_folder), quantization=quantization, int_calibration="none", **LORA, **TEST_ENGINE_KWARGS)
    qkv = llm.engine.loaded.model.layers[0].self_attn.qkv_proj.base
    assert isinstance(qkv, Fp8Linear if quantization == "fp8" else IntLinear)
    check_equals_peft(llm, peft_over(peft_model, llm.engine.loaded.model), prompt_ids, lora_requests, hf_tokenizer)


def test_merging_into_kept_gguf_blocks_runs_the_adapter_unmerged(lora_adapters, lora_requests, prompt_ids,
                                                                   gguf_lora_llm):
    """The same outputs as B over the GGUF blocks through enable_lora (checked against peft above), with or
    without B's LoRARequest (the engine holds no base to run)."""
    _, folders = lora_adapters
    llm = LLM("smollm2-135m-instruct", quantization="gguf", merged_lora=str(folders["B"]), **TEST_ENGINE_KWARGS)
    assert llm.engine.stats["lora"] is not None  # LoRA layers run it
    prompts = [{"prompt_token_ids": prompt_ids[i]} for i in ROWS]
    expected = [out.outputs[0].token_ids for out in
                gguf_lora_llm.generate(prompts, GREEDY, lora_request=lora_requests["B"])]
    assert [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY)] == expected
    assert llm.generate(prompts[:1], GREEDY, lora_request=lora_requests["B"])[0].outputs[0].token_ids == expected[0]


def test_merged_before_int8_quantizing(lora_adapters, smollm_hf_folder):
    """merged_lora with int8 at load (rounded to nearest): the int8 weights are the merged model's,
    quantized (each within half a quantization step of peft's merged weight), not the base's. (With
    activation_aware calibration, the default, its passes run on the merged model as well.)"""
    peft_model, folders = lora_adapters
    merged = copy.deepcopy(peft_model).merge_and_unload(adapter_names=["A"])
    llm = LLM(str(smollm_hf_folder), quantization="int8", int_calibration="none", merged_lora=str(folders["A"]),
              **TEST_ENGINE_KWARGS)
    assert llm.engine.stats["lora"] is None
    ours = dense_weight(llm.engine.loaded.model.layers[0].mlp.down_proj)
    theirs = merged.model.layers[0].mlp.down_proj.weight.float()
    base = peft_model.base_model.model.model.layers[0].mlp.down_proj.base_layer.weight.float()
    step = theirs.abs().amax(dim=1, keepdim=True) / 127  # int8's per-row step at most
    assert ((ours - theirs).abs() <= step / 2 + 1e-6).all()
    assert ((theirs - base).abs() > step).any()  # the merge moved weights by more than a step
