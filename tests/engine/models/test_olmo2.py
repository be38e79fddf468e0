"""OLMo 2 (Olmo2ForCausalLM) against transformers' own class on a tiny random-weight model.

What sets OLMo 2 apart from a Llama block, each on in the tiny model: norms after attention and after
the MLP instead of before (post_attention_layernorm, post_feedforward_layernorm), q/k RMSNorms over
the whole q and k projections (GQA, so their widths differ) before rope, and `attention_bias` (off in
the published checkpoints, on here: q/k/v and o_proj biases). Every weight is drawn at random, norm
gains and biases included, so a tensor loaded into the wrong place changes the logits.

One batch of prompts of different lengths runs with prefix caching (a prompt sharing two blocks with
one already run, and that one again), chunked prefill (16 tokens a step) and a pool small enough to
preempt, on the default CPU path (C attention kernels and C elementwise ops) and on plain torch (the
SDPA backend and the eager ops): greedy tokens equal HF `generate`, every sampled row's logits within
1e-3 of HF's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.kv.capacity import weight_bytes
from batchgen.engine.models.config import ModelConfig
from batchgen.engine.parallel.layout import check_can_split
from batchgen.kernels import cpu_elementwise
from tests.engine.helpers import captured_logits, relative_error, run_requests
from tests.engine.models.test_registry import randomize_weights

LOGITS_TOLERANCE = 1e-3
NUM_TOKENS = 8
SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-6}
SETTINGS = dict(dtype="float32", device="cpu", max_model_len=128, max_num_batched_tokens=16, num_kv_blocks=12)


@pytest.fixture(scope="module")
def olmo2(hf_tokenizer, tmp_path_factory):
    """(HF model, its folder): transformers' Olmo2ForCausalLM with biases on, every weight random."""
    import transformers

    config = transformers.Olmo2Config(vocab_size=len(hf_tokenizer), bos_token_id=1, eos_token_id=2,
                                      pad_token_id=0, attention_bias=True, tie_word_embeddings=False,
                                      rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                                      **SHAPE)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = randomize_weights(transformers.Olmo2ForCausalLM(config).float().eval())
    folder = tmp_path_factory.mktemp("olmo2")
    model.save_pretrained(folder)
    hf_tokenizer.save_pretrained(folder)
    return model, folder


def prompts(vocab_size: int) -> dict[str, list[int]]:
    """Five lengths (5 to 90 tokens); `shared` and `first` begin with the same 40 tokens (2 whole blocks)."""
    gen = torch.Generator().manual_seed(1)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, vocab_size, (n,), generator=gen).tolist()

    prefix = tokens(40)
    return {"first": prefix + tokens(9), "shared": prefix + tokens(23), "short": tokens(17),
            "long": tokens(90), "tiny": tokens(5)}


@torch.no_grad()
def hf_generate(hf, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NUM_TOKENS,
                      min_new_tokens=NUM_TOKENS, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("path", ["c_kernels", "plain_torch"])
@torch.no_grad()
def test_a_batch_with_prefix_caching_chunked_prefill_and_preemption_equals_hf(olmo2, path, monkeypatch):
    hf, folder = olmo2
    if path == "plain_torch":  # as where the C kernels cannot be built: SDPA and the eager ops
        monkeypatch.setattr(cpu_elementwise, "is_available", lambda: False)
        llm = LLM(str(folder), attention_backend="sdpa", **SETTINGS)
        expected_kernels = ("sdpa", "eager")
    else:
        llm = LLM(str(folder), **SETTINGS)
        expected_kernels = ("cpu", "c")
    engine = llm.engine
    kernels = engine.stats["kernels"]
    assert (kernels["attention_backend"], kernels["elementwise_ops"]) == expected_kernels
    assert engine.model_cfg.architecture == "Olmo2ForCausalLM"

    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    batch = prompts(hf.config.vocab_size)
    with captured_logits(engine) as records:
        first = run_requests(engine, {"first": (batch["first"], params)})  # its blocks now cached
        outputs = first | run_requests(engine, {
            **{name: (p, params) for name, p in batch.items() if name != "first"},
            "first-again": (batch["first"], params)})
    assert outputs["shared"].num_cached_tokens == 32  # the two whole blocks of the shared 40 tokens
    assert outputs["first-again"].num_cached_tokens >= 32  # (its third block may be evicted meanwhile)
    assert engine.stats["num_preemptions"] > 0  # 12 blocks do not hold the batch

    for name, out in outputs.items():
        prompt = batch[name.removesuffix("-again")]
        tokens = out.outputs[0].token_ids
        assert tokens == hf_generate(hf, prompt), name
        reference = hf(torch.tensor([prompt + tokens])).logits[0]  # (T, V)
        for j in range(NUM_TOKENS):
            error = relative_error(records[(name, 0, j)], reference[len(prompt) - 1 + j])
            assert error <= LOGITS_TOLERANCE, f"{name} position {j}: {error:.2e}"


def test_the_config_turns_on_whole_projection_qk_norms_and_the_o_proj_bias(olmo2):
    hf, folder = olmo2
    base = {"architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", "vocab_size": 256, **SHAPE}
    plain = ModelConfig.from_hf_dict(base)
    biased = ModelConfig.from_hf_dict({**base, "attention_bias": True})
    assert (plain.qk_norm, plain.qk_norm_over_heads, plain.attention_bias, plain.o_proj_bias) == (
        True, True, False, False)
    assert (biased.attention_bias, biased.o_proj_bias) == (True, True)
    assert ModelConfig.from_hf_dict({"model_type": "olmo2", "vocab_size": 256, **SHAPE}).qk_norm_over_heads
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        ModelConfig.from_hf_dict({**base, "hidden_act": "gelu"})


def test_the_capacity_plan_counts_the_wide_qk_norms_the_post_norms_and_the_o_proj_bias(olmo2):
    _, folder = olmo2
    llm = LLM(str(folder), **SETTINGS)
    cfg = llm.engine.model_cfg
    assert llm.engine.weight_bytes == weight_bytes(cfg, torch.float32)  # the engine measures tensor storage
    # Against Qwen3-style per-head norms and no o_proj bias: the difference is exactly what OLMo 2 adds.
    per_head = dataclasses.replace(cfg, qk_norm_over_heads=False, o_proj_bias=False)
    extra = cfg.num_layers * (cfg.q_size + cfg.kv_size - 2 * cfg.head_dim + cfg.hidden_size) * 4
    assert weight_bytes(cfg, torch.float32) - weight_bytes(per_head, torch.float32) == extra


def test_tensor_parallelism_splits_over_at_most_the_kv_heads_and_refuses_more_by_name():
    cfg = ModelConfig.from_hf_dict({"architectures": ["Olmo2ForCausalLM"], "vocab_size": 256, **SHAPE})
    check_can_split(cfg, 2)  # one KV head a rank: the ranks' k slices partition k
    with pytest.raises(ValueError, match="tensor_parallel_size 3: Olmo2ForCausalLM norms k over all its 2 KV "
                                         "heads.*<= 2"):
        check_can_split(cfg, 3)


@pytest.mark.subprocess
@torch.no_grad()
def test_two_ranks_over_gloo_equal_hf(hf_tokenizer, tmp_path):
    """Tensor parallelism: each rank holds half of q and k and of their norm weights, and the ranks sum
    each token's squares before the norm; tokens equal HF generate's, every sampled row's logits within
    1e-3 of HF's. (No biases: the published checkpoints have none, and a row-parallel o_proj bias is
    refused with tensor_parallel_size > 1.)"""
    import transformers

    config = transformers.Olmo2Config(vocab_size=len(hf_tokenizer), bos_token_id=1, eos_token_id=2,
                                      pad_token_id=0, tie_word_embeddings=False, **SHAPE)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = randomize_weights(transformers.Olmo2ForCausalLM(config).float().eval())
    hf.save_pretrained(tmp_path)
    hf_tokenizer.save_pretrained(tmp_path)
    threads = torch.get_num_threads()
    llm = LLM(str(tmp_path), tensor_parallel_size=2, **{**SETTINGS, "num_kv_blocks": 48})
    try:
        attention = llm.engine.runner.model.layers[0].self_attn
        assert attention.q_norm.weight.shape == (32,) and attention.k_norm.weight.shape == (16,)  # half of each
        torch.testing.assert_close(attention.q_norm.weight, hf.model.layers[0].self_attn.q_norm.weight[:32])
        params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
        batch = prompts(hf.config.vocab_size)
        with captured_logits(llm.engine) as records:
            outputs = run_requests(llm.engine, {name: (p, params) for name, p in batch.items()})
        for name, prompt in batch.items():
            tokens = outputs[name].outputs[0].token_ids
            assert tokens == hf_generate(hf, prompt), name
            reference = hf(torch.tensor([prompt + tokens])).logits[0]
            for j in range(NUM_TOKENS):
                error = relative_error(records[(name, 0, j)], reference[len(prompt) - 1 + j])
                assert error <= LOGITS_TOLERANCE, f"{name} position {j}: {error:.2e}"
    finally:
        llm.engine.shutdown()
        torch.set_num_threads(threads)
