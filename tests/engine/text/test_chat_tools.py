"""LLM.chat with tools on the real model: the tools and a multi-turn tool result rendered as transformers'
apply_chat_template renders them; tool_choice required and a named function forced, each call's
arguments valid against its tool's schema (jsonschema); none answers in text; bad tools name the field."""

from __future__ import annotations

import json

import pytest

from batchgen.engine import SamplingParams
from batchgen.engine.text.tools import ToolsError
from tests.engine.text.tool_template import FEW_SHOT_CALLS, HERMES_TEMPLATE, QUESTION, TOOLS, check_calls

SAMPLED = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=64)


@pytest.fixture(scope="module")
def tools_llm(llm):
    return llm.with_engine_settings(tool_call_parser="hermes", kv_cache_memory="64MiB", max_model_len=1024)


def chat_calls(completion) -> list[dict]:
    return [call.to_openai() for call in completion.tool_calls or []]


@pytest.mark.slow
def test_named_and_required_calls_are_forced_and_validate(tools_llm):
    named = tools_llm.chat(QUESTION, SAMPLED, chat_template=HERMES_TEMPLATE, tools=TOOLS,
                           tool_choice={"type": "function", "function": {"name": "get_time"}})[0]
    assert len(named.outputs) == 2
    for c in named.outputs:
        assert c.finish_reason == "tool_calls" and len(c.tool_calls) == 1, c.text
        check_calls(chat_calls(c), {"get_time"})
        assert c.text.startswith("<tool_call>\n") and c.content == ""
    required = tools_llm.chat(QUESTION, SAMPLED, chat_template=HERMES_TEMPLATE, tools=TOOLS,
                              tool_choice="required")[0]
    for c in required.outputs:  # one call or more; a call max_tokens cut is not one
        check_calls(chat_calls(c))
        assert c.finish_reason in ("tool_calls", "length")


def test_tool_choice_none_answers_in_text_with_the_tools_in_the_prompt(tools_llm):
    hf = tools_llm.get_tokenizer()
    out = tools_llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=8), chat_template=HERMES_TEMPLATE,
                         tools=TOOLS, tool_choice="none")[0]
    expected = hf.apply_chat_template(QUESTION, tools=TOOLS, chat_template=HERMES_TEMPLATE, tokenize=False,
                                      add_generation_prompt=True)
    assert out.prompt_token_ids == hf.encode(expected, add_special_tokens=False)
    assert "<tools>" in expected and '"get_weather"' in expected
    assert out.outputs[0].tool_calls is None and out.outputs[0].text


def test_auto_reads_a_call_the_model_writes_itself(tools_llm):
    out = tools_llm.chat(FEW_SHOT_CALLS, SamplingParams(temperature=0, max_tokens=48), chat_template=HERMES_TEMPLATE,
                         tools=TOOLS)[0].outputs[0]  # tool_choice defaults to auto with a parser
    assert out.finish_reason == "tool_calls" and out.content == "", out.text
    check_calls(chat_calls(out), {"get_weather"})
    assert json.loads(out.tool_calls[0].arguments) == {"city": "Paris", "unit": "celsius"}


def test_a_conversation_with_a_tool_result_renders_as_transformers_and_continues(tools_llm):
    arguments = {"city": "Paris", "unit": "celsius"}
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(arguments)}}
    messages = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18, "sky": "clear"}'},
                {"role": "user", "content": "And should I take an umbrella?"}]
    out = tools_llm.chat(messages, SamplingParams(temperature=0, max_tokens=8), chat_template=HERMES_TEMPLATE,
                         tools=TOOLS, tool_choice="none")[0]
    # transformers' templates take the arguments as an object (vLLM turns the API's JSON text into one)
    as_template = [*messages[:1], {**messages[1], "tool_calls": [{**call, "function": {
        "name": "get_weather", "arguments": arguments}}]}, *messages[2:]]
    hf = tools_llm.get_tokenizer()
    expected = hf.apply_chat_template(as_template, tools=TOOLS, chat_template=HERMES_TEMPLATE, tokenize=False,
                                      add_generation_prompt=True)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"' in expected
    assert "<tool_response>\n{\"temperature\": 18" in expected
    assert out.prompt_token_ids == hf.encode(expected, add_special_tokens=False)
    assert out.outputs[0].text and out.outputs[0].finish_reason == "length"


def test_bad_tools_and_choices_are_refused_naming_the_field(llm, tools_llm):
    with pytest.raises(ToolsError, match=r"tool_choice.function.name: names 'get_date'"):
        tools_llm.chat(QUESTION, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_date"}})
    with pytest.raises(ToolsError, match=r"tools\[0\].function.name"):
        tools_llm.chat(QUESTION, tools=[{"type": "function", "function": {"parameters": {}}}])
    with pytest.raises(ValueError, match="tool_choice auto needs a tool call parser"):
        llm.chat(QUESTION, tools=TOOLS, tool_choice="auto")
    with pytest.raises(ValueError, match="tool_call_parser must be null or one of hermes, llama3_json, mistral"):
        llm.with_engine_settings(tool_call_parser="json")


@pytest.mark.slow
def test_a_forced_call_follows_a_bounded_thinking(llm):
    """With a reasoning parser the call's grammar applies from the end of the thinking on: the sample
    thinks (at most thinking_token_budget tokens), then writes a call that validates."""
    thinking = llm.with_engine_settings(tool_call_parser="hermes", reasoning_parser="deepseek_r1",
                                        kv_cache_memory="64MiB", max_model_len=1024)
    params = SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=72, thinking_token_budget=8)
    out = thinking.chat(QUESTION, params, chat_template=HERMES_TEMPLATE, chat_template_kwargs={"enable_thinking": True},
                        tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})[0]
    for c in out.outputs:
        assert c.reasoning_content and 0 < c.num_reasoning_tokens <= 8, c.text
        assert "</think>" in c.text and "<tool_call>" not in c.reasoning_content
        assert c.finish_reason == "tool_calls" and len(c.tool_calls) == 1, c.text
        check_calls(chat_calls(c), {"get_weather"})


@pytest.mark.parametrize("parser", ["llama3_json", "mistral"])
def test_each_format_writes_a_forced_call_its_parser_reads_back(llm, parser):
    other = llm.with_engine_settings(tool_call_parser=parser, kv_cache_memory="64MiB", max_model_len=1024)
    out = other.chat(QUESTION, SamplingParams(temperature=0, max_tokens=48), chat_template=HERMES_TEMPLATE,
                     tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})[0].outputs[0]
    assert out.text.startswith("{" if parser == "llama3_json" else "[TOOL_CALLS][{"), out.text
    assert out.finish_reason == "tool_calls" and len(out.tool_calls) == 1, out.text
    check_calls(chat_calls(out), {"get_time"})
