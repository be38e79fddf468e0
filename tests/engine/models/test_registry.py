"""The model registry: every registered HF architecture runs as its transformers class does; an
architecture that is not registered is refused by name, with the supported ones listed.

Each architecture is built by transformers itself from a tiny config (seeded random weights, float32,
eager attention, `save_pretrained` beside the bundled tokenizer, whose vocabulary it uses), loaded
from that folder by name alone, and its logits compared with transformers' on every sampled row.
"""

from __future__ import annotations

import pytest
import torch

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.loader.gguf_loader import row_permutation
from batchgen.engine.models.config import ModelConfig
from batchgen.engine.models.layers.causal_lm import CausalLM
from batchgen.engine.models.registry import ARCHITECTURES, gguf_architecture, hf_architecture, model_class
from tests.engine.helpers import captured_logits, relative_error, run_requests

LOGITS_TOLERANCE = 1e-3
TINY_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-6}


def tiny_hf_model(architecture: str, vocab_size: int, **config_keys):
    """transformers' class named `architecture`, tiny, every weight (biases, norm gains) drawn at random;
    `config_keys` over the tiny shape."""
    import transformers

    config = transformers.AutoConfig.for_model(
        ARCHITECTURES[architecture].model_type, vocab_size=vocab_size, bos_token_id=1, eos_token_id=2,
        pad_token_id=0,  # GLM-4's default pad id is past the vocabulary
        tie_word_embeddings=False, **{**TINY_SHAPE, **config_keys})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return randomize_weights(getattr(transformers, architecture)(config).float().eval())


@torch.no_grad()
def randomize_weights(model):
    """Every weight drawn at random (seeded by the caller): norm gains in [0.5, 1.5], the rest N(0, 0.3),
    so attention is far from uniform and positions matter."""
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.uniform_(0.5, 1.5)
        else:
            param.normal_(0.0, 0.3)
    return model


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
@torch.no_grad()
def test_every_registered_architecture_matches_its_transformers_class(architecture, hf_tokenizer, tmp_path):
    hf = tiny_hf_model(architecture, len(hf_tokenizer))
    hf.save_pretrained(tmp_path)
    hf_tokenizer.save_pretrained(tmp_path)

    # A 16-token step budget: the 40-token prompt prefills in chunks, its decodes read the paged cache.
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", max_model_len=128, num_kv_blocks=16,
              max_num_batched_tokens=16)
    assert llm.engine.model_cfg.architecture == architecture
    assert type(llm.engine.runner.model) is ARCHITECTURES[architecture].model_class

    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, len(hf_tokenizer), (40,), generator=gen).tolist()
    num_tokens = 4
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    with captured_logits(llm.engine) as records:
        output = run_requests(llm.engine, {"p": (prompt, params)})["p"].outputs[0].token_ids
    reference = hf(torch.tensor([prompt + output])).logits[0]  # (T, V)
    for j in range(num_tokens):
        error = relative_error(records[("p", 0, j)], reference[len(prompt) - 1 + j])
        assert error <= LOGITS_TOLERANCE, f"{architecture} position {j}: {error:.2e}"


def hf_config(**keys) -> dict:
    return {"vocab_size": 256, **TINY_SHAPE, **keys}


def test_every_registered_class_is_a_causal_lm_and_every_model_type_finds_its_architecture():
    for name, arch in ARCHITECTURES.items():
        assert issubclass(arch.model_class, CausalLM), name
        found = hf_architecture({"model_type": arch.model_type})
        assert ARCHITECTURES[found].model_type == arch.model_type
        if arch.gguf_name is not None:
            assert gguf_architecture(arch.gguf_name, "x.gguf") == name


def test_the_family_reads_its_own_config_fields():
    """What HF's classes always have but config.json does not state: Qwen2's q/k/v bias, Qwen3's q/k norms."""
    qwen2 = ModelConfig.from_hf_dict(hf_config(architectures=["Qwen2ForCausalLM"], model_type="qwen2"))
    qwen3 = ModelConfig.from_hf_dict(hf_config(model_type="qwen3"))  # no `architectures`: by model_type
    llama = ModelConfig.from_hf_dict(hf_config())  # neither: Llama, as config.json files of old
    assert (qwen2.architecture, qwen2.attention_bias, qwen2.qk_norm) == ("Qwen2ForCausalLM", True, False)
    assert (qwen3.architecture, qwen3.attention_bias, qwen3.qk_norm) == ("Qwen3ForCausalLM", False, True)
    assert (llama.architecture, llama.model_type, llama.attention_bias, llama.qk_norm) == (
        "LlamaForCausalLM", "llama", False, False)
    assert model_class(llama) is ARCHITECTURES["LlamaForCausalLM"].model_class


def test_gguf_rows_are_permuted_for_the_families_llama_cpp_permutes():
    llama = ModelConfig.from_hf_dict(hf_config(architectures=["MistralForCausalLM"], model_type="mistral"))
    qwen3 = ModelConfig.from_hf_dict(hf_config(architectures=["Qwen3ForCausalLM"], model_type="qwen3"))
    assert row_permutation(llama, "attn_q", 64) is not None
    assert row_permutation(qwen3, "attn_q", 64) is None


@pytest.mark.parametrize("keys, asked", [
    ({"architectures": ["GemmaForCausalLM"], "model_type": "gemma"}, "'GemmaForCausalLM'"),
    ({"model_type": "gemma"}, "model_type 'gemma'"),
])
def test_an_unknown_architecture_is_refused_by_name_with_the_supported_ones(keys, asked):
    with pytest.raises(ValueError, match="is not supported") as error:
        ModelConfig.from_hf_dict(hf_config(**keys))
    message = str(error.value)
    assert asked in message
    assert all(name in message for name in ARCHITECTURES), message


def test_an_unknown_gguf_architecture_and_a_config_built_in_code_are_refused_too():
    with pytest.raises(ValueError, match=r"model\.gguf: architecture 'falcon' is not supported \(llama, "):
        gguf_architecture("falcon", "model.gguf")
    cfg = ModelConfig.from_hf_dict(hf_config())
    with pytest.raises(ValueError, match="'PhiForCausalLM' is not supported; supported: LlamaForCausalLM"):
        model_class(ModelConfig(**{**cfg.__dict__, "architecture": "PhiForCausalLM"}))
