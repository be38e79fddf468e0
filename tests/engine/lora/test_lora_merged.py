"""EngineConfig.merged_lora: adapter A merged into the weights at load (before oneDNN packing) gives the
greedy tokens and prompt log-probabilities of peft's merge_and_unload model; the merged adapter's
LoRARequest runs the same, another adapter is refused, and the merge is the engine's own copy (an
engine sharing weights may not change it; the base engine's outputs stay the base's)."""

from __future__ import annotations

import copy

import pytest
import torch

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.lora import LoRAError
from tests.conftest import TEST_ENGINE_KWARGS
from tests.engine.helpers import hf_greedy
from tests.engine.lora.conftest import NUM_TOKENS

GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS)
ROWS = list(range(8))


@pytest.fixture(scope="module")
def merged_llm(lora_adapters, smollm_hf_folder):
    _, folders = lora_adapters
    return LLM(str(smollm_hf_folder), merged_lora=str(folders["A"]), **TEST_ENGINE_KWARGS)


@pytest.fixture(scope="module")
def peft_merged(lora_adapters):
    """peft's own merge of A into a copy of the base (merge_and_unload), the model a user would save."""
    peft_model, _ = lora_adapters
    merged = copy.deepcopy(peft_model).merge_and_unload(adapter_names=["A"])
    merged.eval()
    return merged


def test_merged_adapter_equals_peft_merge_and_unload(merged_llm, peft_merged, prompt_ids, lora_requests,
                                                     hf_tokenizer):
    prompts = [prompt_ids[i] for i in ROWS]
    expected = hf_greedy(peft_merged, prompts, NUM_TOKENS, merged_llm.engine.eos_token_ids, hf_tokenizer.pad_token_id)
    outputs = merged_llm.generate([{"prompt_token_ids": ids} for ids in prompts], GREEDY)
    assert [out.outputs[0].token_ids for out in outputs] == expected
    # the merged adapter's own LoRARequest (a job's rows name it) runs the merged weights too
    again = merged_llm.generate([{"prompt_token_ids": ids} for ids in prompts[:2]], GREEDY,
                                lora_request=lora_requests["A"])
    assert [out.outputs[0].token_ids for out in again] == expected[:2]
    assert merged_llm.engine.stats["lora"] is None  # no LoRA layer runs
    mlp = merged_llm.engine.loaded.model.layers[0].mlp
    if merged_llm.engine.capabilities.is_onednn_silu_mul:  # packed (with the SiLU epilogue) after the merge
        assert getattr(mlp.gate_up_proj, "applies_silu_mul", False)


def test_merged_prompt_logprobs_within_1e4_of_peft(merged_llm, peft_merged, prompt_ids):
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outputs = merged_llm.generate([{"prompt_token_ids": prompt_ids[i]} for i in ROWS[:3]], params)
    for i, out in zip(ROWS, outputs):
        ids = prompt_ids[i]
        ours = torch.tensor([position[t].logprob for position, t in zip(out.prompt_logprobs[1:], ids[1:])])
        with torch.no_grad():
            logits = peft_merged(torch.tensor([ids])).logits[0].float()
        expected = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        assert (ours - expected).abs().max().item() <= 1e-4, f"prompt {i}"


def test_another_adapter_is_refused_and_the_merge_is_not_shared(merged_llm, lora_llm, lora_requests, prompt_ids):
    with pytest.raises(LoRAError, match=r"'B'.*merged_lora"):
        merged_llm.generate([{"prompt_token_ids": prompt_ids[0]}], GREEDY, lora_request=lora_requests["B"])
    with pytest.raises(ValueError, match="merged_lora"):
        lora_llm.with_engine_settings(enable_lora=False, merged_lora="elsewhere")
    # the base engine loaded its own weights: its base rows are not A's
    base = lora_llm.generate([{"prompt_token_ids": prompt_ids[i]} for i in ROWS[:4]], GREEDY)
    merged = merged_llm.generate([{"prompt_token_ids": prompt_ids[i]} for i in ROWS[:4]], GREEDY)
    assert any(b.outputs[0].token_ids != m.outputs[0].token_ids for b, m in zip(base, merged))
