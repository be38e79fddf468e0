"""Tensor parallelism over a mixture-of-experts model (CPU, gloo, 2 processes): every rank holds every
expert's slice of the expert channels (and of the dense layer's MLP channels), the MoE block's partial
sums are all-reduced as the dense MLP's. A tiny Qwen3-MoE (a dense layer among sparse ones, 16 experts
top 4) gives the same greedy tokens at tp=2 as in one process, on 8 prompts batched with chunked prefill."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.models.config import ModelConfig
from batchgen.engine.parallel.layout import TensorParallelLayout, check_can_split
from tests.engine.helpers import run_requests
from tests.engine.models.test_moe import ATTENTION, FAMILIES, SETTINGS
from tests.engine.models.test_registry import randomize_weights

pytestmark = pytest.mark.subprocess

ARCHITECTURE = "Qwen3MoeForCausalLM"


@pytest.fixture(scope="module")
def qwen3_moe_folder(hf_tokenizer, tmp_path_factory):
    import transformers

    config = transformers.Qwen3MoeConfig(vocab_size=len(hf_tokenizer), **ATTENTION, **FAMILIES[ARCHITECTURE])
    torch.manual_seed(0)
    model = randomize_weights(transformers.Qwen3MoeForCausalLM(config).float().eval())
    folder = tmp_path_factory.mktemp("qwen3-moe-tp")
    model.save_pretrained(folder)
    hf_tokenizer.save_pretrained(folder)
    return folder


def test_the_layout_gives_each_rank_every_experts_slice_of_channels():
    cfg = ModelConfig.from_hf_dict({"architectures": [ARCHITECTURE], "vocab_size": 256, **ATTENTION,
                                    **FAMILIES[ARCHITECTURE]})
    layout = TensorParallelLayout.plan(cfg, 1, 2)
    assert layout.rank_config(cfg).moe_intermediate_size == 16 and layout.rank_config(cfg).intermediate_size == 48
    assert layout.shard("model.layers.0.mlp.experts.5.gate_proj.weight", (32, 64)) == (0, 16, 32, 16)
    assert layout.shard("model.layers.0.mlp.experts.5.down_proj.weight", (64, 32)) == (1, 16, 32, 16)
    assert layout.shard("model.layers.1.mlp.down_proj.weight", (64, 96)) == (1, 48, 96, 48)  # the dense layer
    assert layout.shard("model.layers.0.mlp.gate.weight", (16, 64)) is None  # the router: whole on every rank
    assert layout.shard("model.layers.0.mlp.experts.gate_up_proj", (16, 64, 64)) is None  # fused: cut on loading
    with pytest.raises(ValueError, match="expert biases and scales do not yet"):
        layout.shard("model.layers.0.mlp.experts.5.gate_proj.bias", (32,))
    with pytest.raises(ValueError, match="exceeds the experts' 1 channels"):
        check_can_split(dataclasses.replace(cfg, moe_intermediate_size=1), 2)


@torch.no_grad()
def test_tp2_greedy_tokens_equal_one_process(qwen3_moe_folder):
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in (7, 19, 33, 50, 12, 41, 26, 64)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    settings = dict(SETTINGS, max_num_batched_tokens=48)
    one = LLM(str(qwen3_moe_folder), **settings)
    expected = run_requests(one.engine, {f"p{i}": (p, params) for i, p in enumerate(prompts)})
    threads = torch.get_num_threads()
    tp = LLM(str(qwen3_moe_folder), tensor_parallel_size=2, **settings)
    try:
        got = run_requests(tp.engine, {f"p{i}": (p, params) for i, p in enumerate(prompts)})
    finally:
        tp.engine.shutdown()
        torch.set_num_threads(threads)
    assert {k: v.outputs[0].token_ids for k, v in got.items()} == {k: v.outputs[0].token_ids for k, v in expected.items()}


def test_the_layout_splits_a_shared_experts_channels_and_keeps_its_gate_whole():
    cfg = ModelConfig.from_hf_dict({"architectures": ["Qwen2MoeForCausalLM"], "vocab_size": 256, **ATTENTION,
                                    **FAMILIES["Qwen2MoeForCausalLM"]})
    layout = TensorParallelLayout.plan(cfg, 1, 2)
    assert layout.rank_config(cfg).shared_expert_intermediate_size == 24
    assert layout.shard("model.layers.0.mlp.shared_expert.gate_proj.weight", (48, 64)) == (0, 24, 48, 24)
    assert layout.shard("model.layers.0.mlp.shared_expert.down_proj.weight", (64, 48)) == (1, 24, 48, 24)
    assert layout.shard("model.layers.0.mlp.shared_expert_gate.weight", (1, 64)) is None
    assert layout.shard("model.layers.2.mlp.gate_proj.weight", (96, 64)) == (0, 48, 96, 48)  # the dense layer's


@torch.no_grad()
def test_tp2_with_a_shared_expert_equals_one_process(hf_tokenizer, tmp_path):
    """Qwen2-MoE: every rank holds half the shared expert's channels; its sigmoid gate, the same on every
    rank, scales the partial sums the block's all-reduce adds up."""
    import transformers

    config = transformers.Qwen2MoeConfig(vocab_size=len(hf_tokenizer), **ATTENTION, **FAMILIES["Qwen2MoeForCausalLM"])
    torch.manual_seed(2)
    randomize_weights(transformers.Qwen2MoeForCausalLM(config).float().eval()).save_pretrained(tmp_path)
    hf_tokenizer.save_pretrained(tmp_path)
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in (11, 29, 47)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    requests = {f"p{i}": (p, params) for i, p in enumerate(prompts)}
    expected = run_requests(LLM(str(tmp_path), **SETTINGS).engine, requests)
    threads = torch.get_num_threads()
    tp = LLM(str(tmp_path), tensor_parallel_size=2, **SETTINGS)
    try:
        got = run_requests(tp.engine, requests)
    finally:
        tp.engine.shutdown()
        torch.set_num_threads(threads)
    assert {k: v.outputs[0].token_ids for k, v in got.items()} == {k: v.outputs[0].token_ids for k, v in expected.items()}


@torch.no_grad()
def test_tp2_on_experts_stored_fused_equals_one_process(qwen3_moe_folder, tmp_path):
    """The (E, 2I, H) / (E, H, I) tensors transformers 5.x holds in memory, saved as they are: each rank reads
    them whole and keeps its gate, up and down ranges; tokens equal the per-expert folder's in one process."""
    import shutil

    import transformers
    from safetensors.torch import save_file

    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(qwen3_moe_folder)
    for path in qwen3_moe_folder.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, tmp_path / path.name)
    state = {name: tensor.contiguous() for name, tensor in hf.state_dict().items()}
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in state)
    save_file(state, str(tmp_path / "model.safetensors"))
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in (13, 38)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    requests = {f"p{i}": (p, params) for i, p in enumerate(prompts)}
    expected = run_requests(LLM(str(qwen3_moe_folder), **SETTINGS).engine, requests)
    threads = torch.get_num_threads()
    tp = LLM(str(tmp_path), tensor_parallel_size=2, **SETTINGS)
    try:
        got = run_requests(tp.engine, requests)
    finally:
        tp.engine.shutdown()
        torch.set_num_threads(threads)
    assert {k: v.outputs[0].token_ids for k, v in got.items()} == {k: v.outputs[0].token_ids for k, v in expected.items()}
