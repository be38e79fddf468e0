"""GPTQ, AWQ and compressed-tensors checkpoints loaded as published: exact weights, HF's greedy tokens.

The folders are written by the test packers (int_tiny.py) onto a tiny random Llama; the reference is
HF transformers running the dequantized float weights. batchgen loads each folder with
`quantization: auto` (the declared quantization_config decides) into IntLinear layers.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.config import EngineConfig
from batchgen.engine.kv.capacity import weight_bytes
from batchgen.engine.loader.model_loader import load_model
from batchgen.engine.quant.int_checkpoint import IntLinearParts
from batchgen.engine.quant.int_linear import IntLinear
from batchgen.engine.quant.methods import declared_quantization
from tests.engine.helpers import hf_greedy, run_requests
from tests.engine.int_tiny import VARIANTS, write_int_checkpoint

ENGINE = dict(dtype="float32", device="cpu", kv_cache_memory="16MiB", max_model_len=256)
NUM_PROMPTS, MAX_TOKENS = 16, 10
METHOD = {"gptq-v1-act-order": "gptq", "gptq-v2-8bit": "gptq", "awq": "awq", "compressed-tensors": "compressed-tensors"}


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request, tmp_path_factory):
    folder, hf_model = write_int_checkpoint(tmp_path_factory.mktemp("intckpt"), request.param)
    return request.param, folder, hf_model


def prompts() -> list[list[int]]:
    rng = random.Random(16)
    return [[rng.randrange(3, 256) for _ in range(rng.randint(3, 12))] for _ in range(NUM_PROMPTS)]


def dequantized(module) -> torch.Tensor:
    """The float weight a loaded integer layer multiplies by, from its dequantizing kernel."""
    if isinstance(module, IntLinearParts):
        return torch.cat([dequantized(p) for p in module.parts])
    kernel = next(k for _, k in module.plan if k.name == "dequant")
    return kernel.dequantize_rows(0, module.out_features)


def test_weights_are_the_packers_floats_exactly(checkpoint):
    variant, folder, hf_model = checkpoint
    model = load_model(EngineConfig(model=str(folder), **ENGINE)).model
    hf = hf_model.state_dict()
    layers = {n: m for n, m in model.named_modules() if isinstance(m, (IntLinear, IntLinearParts))
              and ".parts." not in n}
    assert len(layers) == 4 * 2  # qkv, o, gate_up, down in both layers; lm_head stays float
    for i in range(2):
        p = f"model.layers.{i}"
        expected = {
            f"layers.{i}.self_attn.qkv_proj": torch.cat([hf[f"{p}.self_attn.{x}_proj.weight"] for x in "qkv"]),
            f"layers.{i}.self_attn.o_proj": hf[f"{p}.self_attn.o_proj.weight"],
            f"layers.{i}.mlp.gate_up_proj": torch.cat([hf[f"{p}.mlp.gate_proj.weight"], hf[f"{p}.mlp.up_proj.weight"]]),
            f"layers.{i}.mlp.down_proj": hf[f"{p}.mlp.down_proj.weight"],
        }
        for name, weight in expected.items():
            assert torch.equal(dequantized(layers[name]), weight), (variant, name)
    # Act-order layers whose q/k/v permutations differ keep their parts; the others are fused.
    assert isinstance(layers["layers.0.self_attn.qkv_proj"], IntLinearParts) == (variant == "gptq-v1-act-order")


def test_greedy_tokens_equal_hf_on_the_dequantized_weights(checkpoint):
    variant, folder, hf_model = checkpoint
    llm = LLM(str(folder), **ENGINE)
    weights = llm.engine.stats["weights"]
    assert (weights["format"], weights["origin"], weights["num_linear_layers"]) == (METHOD[variant], "checkpoint", 8)
    ids = prompts()
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = run_requests(llm.engine, {f"p{i}": (p, params) for i, p in enumerate(ids)})
    ours = [outputs[f"p{i}"].outputs[0].token_ids for i in range(NUM_PROMPTS)]
    reference = hf_greedy(hf_model, ids, MAX_TOKENS, (), pad_token_id=0)
    assert ours == reference, variant
    # The planner's bytes equal the engine's (act-order parts each hold a g_idx: the plan counts one per layer).
    if variant != "gptq-v1-act-order":
        cfg = llm.engine.model_cfg
        declared = declared_quantization(json.loads((folder / "config.json").read_text()), str(folder))
        assert weight_bytes(cfg, torch.float32, METHOD[variant], declared=declared) == llm.engine.weight_bytes


def test_a_conflicting_quantization_is_refused_naming_both(checkpoint, tmp_path):
    variant, folder, _ = checkpoint
    with pytest.raises(ValueError, match=f"int4 conflicts with .*declares {METHOD[variant]}"):
        load_model(EngineConfig(model=str(folder), quantization="int4", **ENGINE))
    if variant == "awq":  # and an integer format asked of a float folder, through a job: exit 2 material
        from batchgen.pipeline.config import load_job
        from batchgen.pipeline.errors import JobError
        from batchgen.pipeline.model_limits import check_model_limits

        float_folder = folder.parent / "awq-float"
        job = tmp_path / "job.yaml"
        job.write_text(f"name: q\nmodel:\n  path: {float_folder}\n  quantization: gptq\n"
                       f"input:\n  path: {tmp_path}/in.jsonl\noutput:\n  path: {tmp_path}/out\n")
        with pytest.raises(JobError, match="model.quantization: .*gptq conflicts with .*declares no quantization"):
            check_model_limits(load_job(str(job)))
