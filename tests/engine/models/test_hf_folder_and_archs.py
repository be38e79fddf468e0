"""HF model folders: SmolLM2 re-saved as sharded safetensors equals the GGUF; tiny random-weight
Llama, Qwen2 (qkv bias), Qwen3 (q/k norms) and Llama-3 rope-scaled models match HF's logits.

The tiny models are written by transformers itself (config.json in its own naming, including
transformers 5's rope_parameters) with every weight drawn at random, biases and norm gains included,
so a tensor that is loaded into the wrong place or skipped changes the logits.
"""

from __future__ import annotations

import json

import pytest
import torch

from batchgen.engine import LLM, SamplingParams
from tests.conftest import TEST_ENGINE_KWARGS
from tests.engine.helpers import captured_logits, relative_error, run_requests
from tests.engine.prompts import BOUNDARY_CHATS, CHAT_PROMPTS, LONG_CHAT

LOGITS_TOLERANCE = 1e-3


# ---- SmolLM2 as a sharded HF folder ---------------------------------------------------------------

def test_sharded_hf_folder_gives_the_gguf_outputs(llm, smollm_hf_folder):
    smollm_folder = smollm_hf_folder
    shards = sorted(smollm_folder.glob("*.safetensors"))
    assert len(shards) > 1 and (smollm_folder / "model.safetensors.index.json").exists()
    assert "tie_word_embeddings" in json.loads((smollm_folder / "config.json").read_text())

    folder_llm = LLM(str(smollm_folder), **TEST_ENGINE_KWARGS)
    # A fresh pool for the GGUF side too: both runs start with an empty prefix cache, so they batch
    # and chunk the same way and may be compared bit for bit.
    gguf_llm = llm.with_engine_settings()
    assert folder_llm.engine.model_cfg.tie_word_embeddings
    assert folder_llm.engine.eos_token_ids == gguf_llm.engine.eos_token_ids
    folder_weights = dict(folder_llm.engine.runner.model.named_parameters())
    gguf_weights = dict(gguf_llm.engine.runner.model.named_parameters())
    assert folder_weights.keys() == gguf_weights.keys()
    for name, weight in gguf_weights.items():
        assert torch.equal(folder_weights[name], weight), name

    prompts = [BOUNDARY_CHATS[16], CHAT_PROMPTS[8], LONG_CHAT, "Once upon a time"]
    for messages in prompts[:3]:  # the folder's own tokenizer and chat template
        assert folder_llm.engine.encode(messages) == gguf_llm.engine.encode(messages)
    params = SamplingParams(temperature=0, max_tokens=24)
    requests = {f"folder-{i}": (p, params) for i, p in enumerate(prompts)}
    with captured_logits(gguf_llm.engine) as gguf_logits:
        gguf_out = run_requests(gguf_llm.engine, requests)
    with captured_logits(folder_llm.engine) as folder_logits:
        folder_out = run_requests(folder_llm.engine, requests)
    for request_id in requests:
        assert folder_out[request_id].outputs[0].token_ids == gguf_out[request_id].outputs[0].token_ids
        assert folder_out[request_id].outputs[0].text == gguf_out[request_id].outputs[0].text
    assert folder_logits.keys() == gguf_logits.keys()
    for key, logits in gguf_logits.items():
        assert torch.equal(folder_logits[key], logits), key


# ---- tiny random-weight architectures ---------------------------------------------------------------

def tiny_model(arch: str):
    """(HF model, HF model of the same weights without rope scaling or None) for one architecture."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    # vocab_size matches the SmolLM2 tokenizer saved next to the weights.
    common = {"vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
              "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2}
    llama3_rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    if arch == "llama":
        config_cls, model_cls, extra = LlamaConfig, LlamaForCausalLM, {"tie_word_embeddings": True}
    elif arch == "llama3-rope":
        config_cls, model_cls, extra = LlamaConfig, LlamaForCausalLM, {"rope_parameters": llama3_rope}
    elif arch == "qwen2":
        config_cls, model_cls, extra = Qwen2Config, Qwen2ForCausalLM, {"rope_parameters": {
            "rope_type": "default", "rope_theta": 1_000_000.0}}
    else:  # qwen3: head_dim 32 with hidden 64 and 4 heads, so q/k/v width differs from hidden
        config_cls, model_cls, extra = Qwen3Config, Qwen3ForCausalLM, {"head_dim": 32}
    torch.manual_seed(0)
    model = model_cls(config_cls(**common, **extra)).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            else:
                # Large enough that attention is far from uniform, so positions (rope) matter.
                param.normal_(0.0, 0.3)
    unscaled = None
    if arch == "llama3-rope":
        unscaled = model_cls(config_cls(**common)).float().eval()
        unscaled.load_state_dict(model.state_dict())
    return model, unscaled


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "llama3-rope"])
@torch.no_grad()
def test_tiny_architectures_match_hf_logits(arch, hf_tokenizer, tmp_path):
    hf, unscaled = tiny_model(arch)
    hf.save_pretrained(tmp_path)
    hf_tokenizer.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == {"llama3-rope": "llama"}.get(arch, arch)

    # A 32-token step budget: the 40- and 70-token prompts also prefill in chunks.
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", max_model_len=256, num_kv_blocks=48,
              max_num_batched_tokens=32)
    cfg = llm.engine.model_cfg
    assert cfg.attention_bias == (arch == "qwen2") and cfg.qk_norm == (arch == "qwen3")
    assert (cfg.rope_scaling or {}).get("rope_type", "default") == ("llama3" if arch == "llama3-rope" else "default")

    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (5, 16, 17, 40, 70)]
    num_tokens = 6
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    with captured_logits(llm.engine) as records:
        outputs = run_requests(llm.engine, {f"p{i}": (ids, params) for i, ids in enumerate(prompts)})
    for i, prompt in enumerate(prompts):
        output = outputs[f"p{i}"].outputs[0].token_ids
        reference = hf(torch.tensor([prompt + output])).logits[0]  # (T, V)
        for j in range(num_tokens):
            error = relative_error(records[(f"p{i}", 0, j)], reference[len(prompt) - 1 + j])
            assert error <= LOGITS_TOLERANCE, f"{arch} prompt {i} position {j}: {error:.2e}"
    if unscaled is not None:
        # The prompts reach far enough for the scaling to matter: without it the logits move a lot.
        ids = torch.tensor([prompts[-1]])
        assert relative_error(unscaled(ids).logits[0], hf(ids).logits[0]) > 1e-2
