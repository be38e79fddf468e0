"""SmolLM2-135M-Instruct (GGUF) against HF transformers on the same weights, float32.

Logits: every logits row our sampler is handed (prefill and decode steps, through the paged KV
cache) against HF's full forward over the same tokens. Greedy continuations: 22 chat prompts,
48 tokens each, token-identical to HF generate, once with default settings and once with a 64-token
step budget that forces chunked prefill and steps mixing prefill chunks with decodes.
"""

from __future__ import annotations

import pytest
import torch

from batchgen.engine import SamplingParams
from tests.engine.helpers import (
    GREEDY,
    NUM_GREEDY_TOKENS,
    captured_logits,
    divergence_report,
    relative_error,
    run_requests,
)
from tests.engine.prompts import BOUNDARY_CHATS, CHAT_PROMPTS, LONG_CHAT, LONG_INDEX

LOGITS_TOLERANCE = 1e-3  # max|ours - HF| / max|HF|, per row


def test_prompts_have_the_intended_token_counts(llm, hf_tokenizer, chat_prompt_ids):
    for num_tokens, messages in BOUNDARY_CHATS.items():
        assert len(llm.engine.encode(messages)) == num_tokens
    assert len(chat_prompt_ids[LONG_INDEX]) > 64
    # Our chat path tokenizes exactly as HF's tokenizer renders the template.
    for messages, ids in zip(CHAT_PROMPTS, chat_prompt_ids):
        text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ids == hf_tokenizer.encode(text, add_special_tokens=False)


@torch.no_grad()
def test_logits_match_hf(llm, chunked_llm, hf_model):
    num_tokens = 6
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    cases = [  # (engine, prompt, cached prompt tokens expected or None)
        (llm, "The three primary colors are", None),
        (llm, [1], 0),  # a one-token prompt: its prefill looks like a decode
        (llm, BOUNDARY_CHATS[17], None),
        (llm, CHAT_PROMPTS[7], None),
        (llm, BOUNDARY_CHATS[33], None),
        (llm, BOUNDARY_CHATS[33], 32),  # again: two blocks from the prefix cache, one token computed
        (chunked_llm, LONG_CHAT, None),  # through the chunked engine's 64-token chunks
    ]
    worst = 0.0
    for i, (engine_llm, prompt, num_cached) in enumerate(cases):
        engine = engine_llm.engine
        with captured_logits(engine) as records:
            out = run_requests(engine, {f"logits-{i}": (prompt, params)})[f"logits-{i}"]
        prompt_ids, output_ids = out.prompt_token_ids, out.outputs[0].token_ids
        assert len(output_ids) == num_tokens
        if num_cached is not None:
            assert out.num_cached_tokens == num_cached
        reference = hf_model(torch.tensor([prompt_ids + output_ids])).logits[0].float()  # (T, V)
        for j in range(num_tokens):
            ours = records[(f"logits-{i}", 0, j)]
            error = relative_error(ours, reference[len(prompt_ids) - 1 + j])
            assert error <= LOGITS_TOLERANCE, f"prompt {i}, output position {j}: {error:.2e}"
            worst = max(worst, error)
    print(f"worst relative logits error vs HF: {worst:.2e}")


def assert_matches_hf(outputs: list[list[int]], reference: list[list[int]], prompt_ids, hf_model) -> None:
    mismatches = [f"prompt {i}: {divergence_report(hf_model, prompt_ids[i], ours, ref)}"
                  for i, (ours, ref) in enumerate(zip(outputs, reference)) if ours != ref]
    assert not mismatches, "\n".join(mismatches)


@pytest.mark.slow
def test_greedy_continuations_match_hf_generate(llm_chat_greedy, hf_chat_greedy, chat_prompt_ids, hf_model):
    assert len(llm_chat_greedy) >= 20
    assert_matches_hf(llm_chat_greedy, hf_chat_greedy, chat_prompt_ids, hf_model)
    # Not vacuous: the continuations are long and varied (the greetings may share an answer).
    assert sum(len(t) for t in llm_chat_greedy) > 20 * NUM_GREEDY_TOKENS // 2
    assert len({tuple(t) for t in llm_chat_greedy}) >= len(llm_chat_greedy) - 3


@pytest.mark.slow
def test_chunked_prefill_and_mixed_steps_match_hf_generate(chunked_llm, hf_chat_greedy, chat_prompt_ids,
                                                           hf_model):
    engine = chunked_llm.engine
    before = dict(engine.stats)
    outputs = run_requests(engine, {f"chunk-{i}": (ids, GREEDY) for i, ids in enumerate(chat_prompt_ids)})
    after = engine.stats
    assert after["num_partial_prefills"] > before["num_partial_prefills"]
    assert after["num_mixed_steps"] > before["num_mixed_steps"]
    tokens = [outputs[f"chunk-{i}"].outputs[0].token_ids for i in range(len(chat_prompt_ids))]
    assert_matches_hf(tokens, hf_chat_greedy, chat_prompt_ids, hf_model)
