"""Reasoning in the engine: outputs split by the reasoning parser, thinking counted, and bounded by
SamplingParams.thinking_token_budget (the end marker forced through the sampler's bitmask)."""

from __future__ import annotations

import pytest
import torch

from batchgen.engine import SamplingParams
from batchgen.engine.decoding.structured import allocate_token_bitmask, bitmask_to_allowed
from batchgen.engine.decoding.thinking_budget import ReasoningGate
from tests.conftest import MODEL

# ChatML, with the thinking block opened in the prompt as DeepSeek-R1's template does; enable_thinking
# false renders the closed empty block of Qwen3's template instead.
THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}")
QUESTIONS = ["What is 12 + 30?", "Name three fruits.", "Why is the sky blue?", "Write a haiku about rain.",
             "What is the capital of Spain?", "How many legs has a spider?", "Explain gravity briefly.",
             "Is 17 a prime number?"]
BUDGET = 16


@pytest.fixture(scope="module")
def thinking_llm(llm):
    return llm.with_engine_settings(reasoning_parser="deepseek_r1", kv_cache_memory="64MiB", max_model_len=512)


def end_marker_at(token_ids: list[int], end_ids: list[int]) -> int | None:
    for i in range(len(token_ids) - len(end_ids) + 1):
        if token_ids[i:i + len(end_ids)] == end_ids:
            return i
    return None


def run(llm, budget, **kwargs):
    # min_tokens: EOS cannot end a sample right after its thinking, so each has an answer part.
    params = SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=48, min_tokens=BUDGET + 8,
                            thinking_token_budget=budget)
    return llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], params, chat_template=THINK_TEMPLATE,
                    **kwargs)


@pytest.mark.slow
def test_a_budget_of_16_ends_every_thinking_by_16_tokens_then_the_answer_follows(thinking_llm):
    end_ids = thinking_llm.tokenizer.encode("</think>", add_special_tokens=False)
    outputs = [c for out in run(thinking_llm, BUDGET) for c in out.outputs]
    unbounded = [c for out in run(thinking_llm, None) for c in out.outputs]
    assert len(outputs) == 2 * len(QUESTIONS)
    for c in outputs:
        at = end_marker_at(list(c.token_ids), end_ids)  # where the thinking ended, read from the tokens
        assert at is not None and at <= BUDGET, c.text
        assert c.num_reasoning_tokens == at
        assert c.reasoning_content is not None and "</think>" not in c.reasoning_content
        assert c.content.strip() and "</think>" not in c.content, c.text
        assert c.text.startswith(c.reasoning_content)
    # without the budget the same samples think longer: the budget is what ended them
    assert max(c.num_reasoning_tokens for c in unbounded) > BUDGET
    assert any(c.num_reasoning_tokens == BUDGET for c in outputs)


def test_enable_thinking_false_through_chat_template_kwargs(thinking_llm):
    qwen3 = thinking_llm.with_engine_settings(reasoning_parser="qwen3")
    out = qwen3.chat([{"role": "user", "content": QUESTIONS[0]}], SamplingParams(max_tokens=12),
                     chat_template=THINK_TEMPLATE, chat_template_kwargs={"enable_thinking": False})[0].outputs[0]
    assert out.reasoning_content is None and out.content == out.text.lstrip() and out.num_reasoning_tokens == 0
    out = qwen3.chat([{"role": "user", "content": QUESTIONS[0]}], SamplingParams(max_tokens=12),
                     chat_template=THINK_TEMPLATE)[0].outputs[0]
    assert out.reasoning_content is not None and out.num_reasoning_tokens > 0  # the prompt opened the block


def test_a_budget_without_a_reasoning_parser_is_refused(llm):
    with pytest.raises(ValueError, match="thinking_token_budget needs a reasoning parser"):
        llm.generate("Hi", SamplingParams(max_tokens=4, thinking_token_budget=4))


def test_the_gate_forces_the_end_marker_and_rolls_back():
    gate = ReasoningGate(3, start_ids=[1], end_ids=[7, 8], starts_thinking=True)
    assert gate.accept_tokens([4, 5, 6]) and gate.num_reasoning_tokens == 3
    bitmask = allocate_token_bitmask(2, 40)
    gate.fill_bitmask(bitmask, 0, draft_token_ids=[7])
    allowed = bitmask_to_allowed(bitmask, 40)
    assert torch.nonzero(allowed[0]).flatten().tolist() == [7]
    assert torch.nonzero(allowed[1]).flatten().tolist() == [8]  # the draft's row: the marker's next token
    assert not gate.accept_token(5) and gate.validate_tokens([7, 8, 9]) == 3
    assert gate.accept_tokens([7, 8, 9, 9]) and gate.num_reasoning_tokens == 3
    gate.fill_bitmask(bitmask, 0)
    assert bool(bitmask_to_allowed(bitmask, 40)[0].all())  # the answer is free
    gate.rollback(3)
    assert gate.forced_token() == 8 and gate.num_reasoning_tokens == 3


def test_the_gate_watches_for_the_start_tag_when_the_prompt_did_not_open_it():
    gate = ReasoningGate(2, start_ids=[1, 2], end_ids=[7], starts_thinking=None)
    assert gate.accept_tokens([1, 2, 5, 6]) and gate.forced_token() == 7
    other = ReasoningGate(2, start_ids=[1, 2], end_ids=[7], starts_thinking=None)
    assert other.accept_tokens([1, 3, 5, 6, 6]) and other.forced_token() is None and other.num_reasoning_tokens == 0


@pytest.mark.slow
def test_speculative_drafts_across_the_budget_give_the_same_tokens(thinking_llm):
    """The model drafting for itself proposes thinking tokens past the budget: the gate cuts them where
    the end marker is forced, and greedy outputs equal speculation off token for token."""
    params = SamplingParams(temperature=0, max_tokens=24, thinking_token_budget=8)
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS[:4]]
    expected = thinking_llm.chat(conversations, params, chat_template=THINK_TEMPLATE)
    drafting = thinking_llm.with_engine_settings(speculative={"method": "draft_model", "model": MODEL,
                                                              "num_speculative_tokens": 4, "disable_by_batch_size": 8})
    outputs = drafting.chat(conversations, params, chat_template=THINK_TEMPLATE)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    assert all(o.outputs[0].num_reasoning_tokens == 8 for o in outputs)
    assert drafting.engine.stats["speculative"]["num_draft_tokens"] > 0
