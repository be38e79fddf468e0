"""LoRA adapters against peft: adapters A (rank 8, q/v/down), B (rank 4, rsLoRA, k/o/gate/up) and the
base mixed in one batch give peft's greedy outputs and prompt log-probabilities."""

from __future__ import annotations

import pytest
import torch

from batchgen.engine import SamplingParams
from tests.engine.lora.conftest import ADAPTER_OF, NUM_TOKENS
from tests.lora_adapters import peft_greedy, peft_prompt_logprobs

GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS)


@pytest.fixture(scope="module")
def mixed_outputs(lora_llm, lora_requests, prompt_ids):
    """One generate call: 16 prompts, A, B and the base mixed."""
    requests = [lora_requests[name] if name else None for name in ADAPTER_OF]
    outputs = lora_llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], GREEDY, lora_request=requests)
    return [out.outputs[0].token_ids for out in outputs]


def test_mixed_batch_greedy_equals_peft_for_each_adapter_and_the_base(lora_adapters, lora_llm, prompt_ids,
                                                                       mixed_outputs, hf_tokenizer):
    peft_model, _ = lora_adapters
    eos = lora_llm.engine.eos_token_ids
    for adapter in ("A", "B", None):
        rows = [i for i, name in enumerate(ADAPTER_OF) if name == adapter]
        expected = peft_greedy(peft_model, adapter, [prompt_ids[i] for i in rows], NUM_TOKENS, eos,
                               hf_tokenizer.pad_token_id)
        for i, reference in zip(rows, expected):
            assert mixed_outputs[i] == reference, f"prompt {i}, adapter {adapter}"
    stats = lora_llm.engine.stats["lora"]
    assert stats["tokens_by_adapter"]["A"] > 0 and stats["tokens_by_adapter"]["B"] > 0


def test_adapters_change_the_outputs(lora_llm, lora_requests, prompt_ids, mixed_outputs):
    """The comparison above could not pass with the adapters ignored: the base's own outputs differ. Steps
    without adapter tokens run the base's fused SiLU * up epilogue (oneDNN, where the CPU has it) and give
    the base rows of the mixed batch (checked against peft above)."""
    base = lora_llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], GREEDY)
    rows = [i for i, name in enumerate(ADAPTER_OF) if name is not None]
    num_different = sum(base[i].outputs[0].token_ids != mixed_outputs[i] for i in rows)
    assert num_different >= len(rows) // 2
    for i, name in enumerate(ADAPTER_OF):
        if name is None:
            assert base[i].outputs[0].token_ids == mixed_outputs[i], f"prompt {i}"
    gate_up = lora_llm.engine.loaded.model.layers[0].mlp.gate_up_proj
    assert getattr(gate_up, "applies_silu_mul", False) == lora_llm.engine.capabilities.is_onednn_silu_mul


def test_prompt_logprobs_within_1e4_of_peft(lora_adapters, lora_llm, lora_requests, prompt_ids):
    peft_model, _ = lora_adapters
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    rows = [0, 1, 2, 3]  # A, B, base, A
    requests = [lora_requests[ADAPTER_OF[i]] if ADAPTER_OF[i] else None for i in rows]
    outputs = lora_llm.generate([{"prompt_token_ids": prompt_ids[i]} for i in rows], params, lora_request=requests)
    for i, out in zip(rows, outputs):
        ids = prompt_ids[i]
        ours = torch.tensor([position[t].logprob for position, t in zip(out.prompt_logprobs[1:], ids[1:])])
        expected = torch.tensor(peft_prompt_logprobs(peft_model, ADAPTER_OF[i], ids))
        assert (ours - expected).abs().max().item() <= 1e-4, f"prompt {i}, adapter {ADAPTER_OF[i]}"


def test_scored_continuations_under_an_adapter_equal_peft(lora_adapters, lora_llm, lora_requests):
    """LLM.score_continuations with lora_request: each continuation's summed log-probability is peft's."""
    peft_model, _ = lora_adapters
    contexts = ["The capital of France is", "Two plus two equals"]
    continuations = [[" Paris", " a big city"], [" four", " 5"]]
    requests = [lora_requests["A"], lora_requests["B"]]
    outputs = lora_llm.score_continuations(contexts, continuations, lora_request=requests)
    base = lora_llm.score_continuations(contexts, continuations)
    for out, base_out, request in zip(outputs, base, requests):
        for scored, base_scored in zip(out.continuations, base_out.continuations):
            ids = list(out.prompt_token_ids) + list(scored.token_ids)
            expected = sum(peft_prompt_logprobs(peft_model, request.lora_name, ids)[-len(scored.token_ids):])
            assert abs(scored.sum_logprob - expected) <= 1e-4, (request.lora_name, scored.token_ids)
            assert abs(scored.sum_logprob - base_scored.sum_logprob) > 1e-3  # the adapter changed the score
