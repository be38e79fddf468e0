"""Mixture-of-experts families (Mixtral, Qwen3-MoE, Qwen2-MoE) against transformers' own classes on tiny random models.

Each family is built by transformers (seeded, float32, eager attention, every weight random, norm gains
included) and saved with save_pretrained (per-expert tensors, as the published checkpoints hold them).
The tiny configs have enough experts and tokens that every expert is routed to (asserted through a
hook on HF's routers); Qwen3-MoE has a dense layer among the sparse ones (`mlp_only_layers`) and runs
without `norm_topk_prob` (Mixtral always renormalises), so both router settings are covered; Qwen2-MoE
adds a shared expert beside the routed ones (and q/k/v biases), a dense last layer, and norm_topk_prob.

Shown: prompt log-probabilities within 1e-4 of HF's float32 log-softmax; greedy 32-token outputs equal
to HF `generate` on 8 prompts, each alone and all in one batch with chunked prefill and prefix caching
(two prompts share two blocks); the fused (E, 2I, H) tensors transformers 5.x holds in memory load
as the per-expert ones do; a missing expert tensor is refused by name.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from batchgen.engine import LLM, SamplingParams, capabilities
from batchgen.engine.kv.capacity import num_active_parameters, num_parameters, weight_bytes
from batchgen.engine.models.config import ModelConfig
from tests.engine.helpers import (
    check_greedy_alone_and_batched,
    check_prompt_logprobs,
    run_requests,
    shared_prefix_prompts,
)
from tests.engine.models.test_registry import randomize_weights

NUM_TOKENS = 32
NUM_PROMPTS = 8
ATTENTION = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
             "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
FAMILIES = {
    "MixtralForCausalLM": dict(intermediate_size=48, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "Qwen3MoeForCausalLM": dict(intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, num_experts=16,
                                num_experts_per_tok=4, norm_topk_prob=False, mlp_only_layers=[1], head_dim=16,
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "Qwen2MoeForCausalLM": dict(intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                num_hidden_layers=3, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
                                mlp_only_layers=[2], rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}
SETTINGS = dict(dtype="float32", device="cpu", max_model_len=256, kv_cache_memory="64MiB")


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, hf_tokenizer, tmp_path_factory):
    """(architecture, HF model, its folder)."""
    import transformers

    architecture = request.param
    config_class = getattr(transformers, architecture.replace("ForCausalLM", "Config"))
    config = config_class(vocab_size=len(hf_tokenizer), **ATTENTION, **FAMILIES[architecture])
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = randomize_weights(getattr(transformers, architecture)(config).float().eval())
    folder = tmp_path_factory.mktemp(architecture)
    model.save_pretrained(folder)
    hf_tokenizer.save_pretrained(folder)
    return architecture, model, folder


@pytest.fixture(scope="module")
def prompts(hf_tokenizer) -> list[list[int]]:
    """8 prompts of 6 to 70 tokens; the first two begin with the same 40 tokens (two whole blocks)."""
    return shared_prefix_prompts(len(hf_tokenizer))


def routed_experts(hf) -> dict[str, set[int]]:
    """Install hooks on HF's routers; returns the dict they fill: router name -> experts chosen."""
    seen: dict[str, set[int]] = {}
    for name, module in hf.named_modules():
        if name.endswith("mlp.gate") and hasattr(module, "top_k"):
            def hook(_module, _inputs, output, name=name):
                seen.setdefault(name, set()).update(output[2].flatten().tolist())  # (logits, weights, indices)
            module.register_forward_hook(hook)
    return seen


@torch.no_grad()
def hf_generate(hf, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NUM_TOKENS,
                      min_new_tokens=NUM_TOKENS, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("experts_path", ["onednn_packed", "torch_mm"])
@torch.no_grad()
def test_prompt_logprobs_equal_hfs_log_softmax_and_every_expert_is_routed_to(family, prompts, experts_path, monkeypatch):
    """The experts through prepacked oneDNN layers (the engine's CPU default where oneDNN packs) and through
    the plain grouped torch GEMMs (where it does not)."""
    architecture, hf, folder = family
    if experts_path == "torch_mm":
        monkeypatch.setattr(capabilities, "can_pack", lambda device, dtype: False)
    seen = routed_experts(hf)
    expected = [torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), dim=-1) for ids in prompts]
    num_experts = getattr(hf.config, "num_local_experts", None) or hf.config.num_experts
    num_sparse = sum(1 for i in range(hf.config.num_hidden_layers)
                     if i not in getattr(hf.config, "mlp_only_layers", []))
    assert len(seen) == num_sparse and all(s == set(range(num_experts)) for s in seen.values()), seen

    llm = LLM(str(folder), max_num_batched_tokens=32, **SETTINGS)  # prompts of 33+ tokens prefill in chunks
    assert llm.engine.model_cfg.architecture == architecture and llm.engine.model_cfg.num_experts == num_experts
    experts = llm.engine.runner.model.layers[0].mlp.experts
    assert (experts.packed is not None) == (experts_path == "onednn_packed")
    check_prompt_logprobs(llm.engine, prompts, expected, architecture)


@torch.no_grad()
def test_greedy_tokens_equal_hf_generate_alone_and_batched_with_chunked_prefill_and_prefix_caching(family, prompts):
    architecture, hf, folder = family
    reference = [hf_generate(hf, ids) for ids in prompts]
    assert len(prompts) == NUM_PROMPTS
    check_greedy_alone_and_batched(folder, prompts, reference, NUM_TOKENS, SETTINGS, architecture)


@torch.no_grad()
def test_the_fused_expert_tensors_transformers_holds_in_memory_load_as_the_per_expert_ones(family, prompts, tmp_path):
    from safetensors.torch import save_file

    architecture, hf, folder = family
    for path in folder.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, tmp_path / path.name)
    state = {name: tensor.contiguous() for name, tensor in hf.state_dict().items()}
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in state)  # (E, 2I, H) in memory
    save_file(state, str(tmp_path / "model.safetensors"))
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    runs = []
    for where in (folder, tmp_path):
        llm = LLM(str(where), **SETTINGS)
        out = run_requests(llm.engine, {"p": (prompts[5], params)})["p"]
        runs.append([next(iter(position.values())).logprob for position in out.prompt_logprobs[1:]])
    assert runs[0] == runs[1]


def test_a_missing_expert_tensor_is_refused_by_name(family, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    architecture, _, folder = family
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys() if ".experts.3." not in name or "layers.0." not in name}
    for path in folder.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, tmp_path / path.name)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing expert tensors: layers\.0\.mlp\.experts\.gate_up_proj expert 3"):
        LLM(str(tmp_path), **SETTINGS)


def test_the_config_names_the_dense_layers_and_the_router_setting(family):
    architecture, hf, folder = family
    cfg = ModelConfig.from_hf_dict(json.loads((folder / "config.json").read_text()))
    if architecture == "MixtralForCausalLM":
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.moe_renormalize,
                cfg.moe_dense_layers) == (8, 2, 48, True, ())
    elif architecture == "Qwen2MoeForCausalLM":
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.moe_renormalize,
                cfg.moe_dense_layers, cfg.shared_expert_intermediate_size, cfg.attention_bias, cfg.qk_norm) == (
            16, 4, 32, True, (2,), 48, True, False)
    else:
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.moe_renormalize,
                cfg.moe_dense_layers, cfg.qk_norm) == (16, 4, 32, False, (1,), True)
        # the published key (num_experts) and decoder_sparse_step: every second layer sparse
        stepped = ModelConfig.from_hf_dict({**json.loads((folder / "config.json").read_text()), "num_experts": 16,
                                            "decoder_sparse_step": 2, "mlp_only_layers": [], "norm_topk_prob": True})
        assert (stepped.moe_dense_layers, stepped.moe_renormalize) == ((0, 2), True)
    with pytest.raises(ValueError, match="num_experts_per_tok must be in"):
        ModelConfig.from_hf_dict({**json.loads((folder / "config.json").read_text()), "num_experts_per_tok": 99})


def test_the_capacity_plan_counts_every_expert_and_the_parameters_a_token_runs_through(family):
    """weight_bytes equals the engine's measured storage (experts packed for oneDNN or not) and the HF model's
    parameter count; the active parameters leave out each MoE layer's E - k unrouted experts."""
    architecture, hf, folder = family
    llm = LLM(str(folder), **SETTINGS)
    cfg = llm.engine.model_cfg
    assert llm.engine.weight_bytes == weight_bytes(cfg, torch.float32)
    assert num_parameters(cfg) == sum(p.numel() for p in hf.parameters())
    num_sparse = cfg.num_layers - len(cfg.moe_dense_layers)
    unrouted = (cfg.num_experts - cfg.num_experts_per_tok) * 3 * cfg.moe_intermediate_size * cfg.hidden_size
    assert num_active_parameters(cfg) == num_parameters(cfg) - num_sparse * unrouted
