"""`batchgen serve` with vLLM's tool and reasoning flags (--enable-auto-tool-choice, --tool-call-parser
hermes, --reasoning-parser qwen3, --chat-template a tools-capable template) through the real `openai`
client: tool_choice required and a named function return calls whose arguments validate against the
schema (jsonschema), streamed and not, n = 2; auto reads a call the model wrote itself; none returns
text; a conversation with a tool result goes on; bad tools are a 400 naming the field;
reasoning_content (streamed as deltas too) bounded by thinking_token_budget and counted in usage.

One server subprocess for the module (its own template and flags).
"""

from __future__ import annotations

import json

import openai
import pytest

from tests.conftest import MODEL
from tests.engine.text.tool_template import FEW_SHOT_CALLS, HERMES_TEMPLATE, QUESTION, TOOLS, check_calls
from tests.serve.server_process import ServerProcess

pytestmark = pytest.mark.server

NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tool-serve")
    (folder / "tools.jinja").write_text(HERMES_TEMPLATE)
    server = ServerProcess(folder / "server.log", "--chat-template", str(folder / "tools.jinja"),
                           "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
                           "--max-model-len", "1024", "--kv-cache-memory", "64MiB")
    yield server.wait_ready()
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=180)


def streamed_choices(chunks, n: int) -> list[dict]:
    """Each choice joined from its deltas as OpenAI's client code joins them: content, reasoning_content,
    tool_calls by index (id and name in a call's first piece, argument text after)."""
    choices = [{"content": "", "reasoning_content": "", "tool_calls": {}, "finish_reason": None} for _ in range(n)]
    for chunk in chunks:
        for choice in chunk.choices:
            joined, delta = choices[choice.index], choice.delta
            joined["content"] += delta.content or ""
            joined["reasoning_content"] += (delta.model_extra or {}).get("reasoning_content") or ""
            for call in delta.tool_calls or []:
                slot = joined["tool_calls"].setdefault(call.index, {"id": None, "type": "function",
                                                                    "function": {"name": None, "arguments": ""}})
                if call.id is not None:
                    assert slot["id"] is None
                    slot["id"], slot["function"]["name"] = call.id, call.function.name
                slot["function"]["arguments"] += call.function.arguments or ""
            joined["finish_reason"] = choice.finish_reason or joined["finish_reason"]
    for joined in choices:
        joined["tool_calls"] = [joined["tool_calls"][i] for i in sorted(joined["tool_calls"])]
    return choices


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_forced_calls_validate_streamed_and_not_with_n2(client, tool_choice):
    kwargs = dict(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=tool_choice, n=2, temperature=0.8,
                  seed=11, max_tokens=64, parallel_tool_calls=False)
    reply = client.chat.completions.create(**kwargs)
    assert len(reply.choices) == 2
    names = {"get_weather"} if tool_choice == NAMED else {"get_weather", "get_time"}
    whole = []
    for choice in reply.choices:
        calls = [call.model_dump() for call in choice.message.tool_calls or []]
        check_calls(calls, names)
        assert len(calls) == 1 and choice.finish_reason == "tool_calls" and not choice.message.content
        whole.append([(c["function"]["name"], c["function"]["arguments"]) for c in calls])
    streamed = streamed_choices(list(client.chat.completions.create(**kwargs, stream=True)), 2)
    for joined, expected in zip(streamed, whole):  # the same seeded samples, in pieces
        check_calls(joined["tool_calls"], names)
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in joined["tool_calls"]] == expected
        assert joined["finish_reason"] == "tool_calls" and joined["content"] == ""


def test_tool_choice_none_returns_text_and_a_tool_result_conversation_goes_on(client):
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="none",
                                           max_tokens=12, temperature=0)
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].message.content
    call = {"id": "call_abc", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}
    messages = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_abc", "content": '{"temperature": 18, "sky": "clear"}'}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=12,
                                           temperature=0)
    first = reply.choices[0]
    assert first.message.content or first.message.tool_calls
    assert reply.usage.prompt_tokens > client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, max_tokens=1).usage.prompt_tokens  # the turns were rendered


def test_auto_reads_the_call_the_model_chose_to_write_streamed_and_not(client):
    """tool_choice auto (--enable-auto-tool-choice): nothing forced; after two turns that called the tool,
    the model writes a <tool_call> of its own, read into tool_calls, in a stream too."""
    kwargs = dict(model=MODEL, messages=FEW_SHOT_CALLS, tools=TOOLS, tool_choice="auto", max_tokens=48,
                  temperature=0)
    reply = client.chat.completions.create(**kwargs).choices[0]
    calls = [call.model_dump() for call in reply.message.tool_calls or []]
    check_calls(calls, {"get_weather"})
    assert reply.finish_reason == "tool_calls" and json.loads(calls[0]["function"]["arguments"])["city"] == "Paris"
    (streamed,) = streamed_choices(list(client.chat.completions.create(**kwargs, stream=True)), 1)
    assert [c["function"] for c in streamed["tool_calls"]] == [c["function"] for c in calls]
    assert streamed["finish_reason"] == "tool_calls" and streamed["content"] == ""


def _bad_request(call) -> dict:
    with pytest.raises(openai.BadRequestError) as caught:
        call()
    return caught.value.body


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "not a schema"}}]},
     "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_date"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_tools_are_a_400_naming_the_field(client, extra, param):
    body = _bad_request(lambda: client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4,
                                                               **extra))
    assert body["param"] == param, body


def test_reasoning_content_is_split_bounded_and_streamed(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Why is the sky blue?"}], n=2,
                  temperature=0.8, seed=5, max_tokens=32, extra_body={
                      "chat_template_kwargs": {"enable_thinking": True}, "thinking_token_budget": 16,
                      "min_tokens": 28})
    reply = client.chat.completions.create(**kwargs)
    for choice in reply.choices:
        reasoning = choice.message.model_extra["reasoning_content"]
        assert reasoning and "</think>" not in reasoning and choice.message.content  # an answer follows
    reasoning_tokens = reply.usage.completion_tokens_details.reasoning_tokens
    assert 0 < reasoning_tokens <= 2 * 16
    streamed = streamed_choices(list(client.chat.completions.create(**kwargs, stream=True)), 2)
    assert [(s["reasoning_content"], s["content"]) for s in streamed] == \
        [(c.message.model_extra["reasoning_content"], c.message.content) for c in reply.choices]
