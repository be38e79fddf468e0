"""YaRN rotary scaling (Qwen3's long context, gpt-oss, DeepSeek's mscale variant): the inverse frequencies
and the cos/sin factor equal transformers' own _compute_yarn_parameters on the published settings, and a
tiny Qwen3-MoE with YaRN gives HF's prompt log-probabilities within 1e-4."""

from __future__ import annotations

import pytest
import torch

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.models.layers.rotary import rope_attention_factor, rope_inv_freq
from tests.engine.helpers import run_requests
from tests.engine.models.test_moe import ATTENTION, FAMILIES, SETTINGS
from tests.engine.models.test_registry import randomize_weights

CASES = {
    "qwen3": (128, {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32768}),
    "gpt-oss": (64, {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "original_max_position_embeddings": 4096, "truncate": False}),
    "deepseek-mscale": (64, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32, "beta_slow": 1,
                             "mscale": 0.707, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_frequencies_and_factor_equal_transformers(case):
    import transformers
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    head_dim, scaling = CASES[case]
    config = transformers.Qwen3Config(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                                      max_position_embeddings=int(scaling["factor"] * scaling["original_max_position_embeddings"]),
                                      rope_parameters=dict(scaling))
    inv_freq, factor = _compute_yarn_parameters(config)
    ours = rope_inv_freq(head_dim, scaling["rope_theta"], scaling)
    assert torch.allclose(ours, inv_freq, rtol=1e-6, atol=0), (ours - inv_freq).abs().max()
    assert rope_attention_factor(scaling) == pytest.approx(factor, rel=1e-12)
    assert not torch.allclose(ours, rope_inv_freq(head_dim, scaling["rope_theta"], None))  # it did scale


@torch.no_grad()
def test_a_tiny_qwen3_moe_with_yarn_matches_hf(hf_tokenizer, tmp_path):
    import transformers

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
    keys = {**FAMILIES["Qwen3MoeForCausalLM"], "rope_parameters": rope}
    config = transformers.Qwen3MoeConfig(vocab_size=len(hf_tokenizer), **ATTENTION, **keys)
    config._attn_implementation = "eager"
    torch.manual_seed(8)
    hf = randomize_weights(transformers.Qwen3MoeForCausalLM(config).float().eval())
    hf.save_pretrained(tmp_path)
    hf_tokenizer.save_pretrained(tmp_path)
    gen = torch.Generator().manual_seed(12)
    prompts = [torch.randint(3, len(hf_tokenizer), (n,), generator=gen).tolist() for n in (20, 90)]
    llm = LLM(str(tmp_path), **SETTINGS)
    assert llm.engine.model_cfg.rope_scaling["rope_type"] == "yarn"
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outputs = run_requests(llm.engine, {f"p{i}": (p, params) for i, p in enumerate(prompts)})
    for i, ids in enumerate(prompts):
        want = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
        want = want.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
        ours = torch.tensor([pos[t].logprob for pos, t in zip(outputs[f"p{i}"].prompt_logprobs[1:], ids[1:])])
        assert (ours - want).abs().max().item() <= 1e-4, f"prompt {i}"
