"""Tool-call parsers on outputs in their models' own formats (hermes/Qwen `<tool_call>`, Llama 3.1 JSON,
Mistral `[TOOL_CALLS]`): whole, and streamed in pieces cut anywhere (a marker or a JSON string split
between two deltas), the streamed calls equal to the whole ones; the request checks name the field."""

from __future__ import annotations

import json

import pytest

from batchgen.engine.text.tool_parsers import ToolCallStream, get_tool_parser
from batchgen.engine.text.tools import ToolsError, check_tool_choice, check_tools, parse_tool_output

# Qwen2.5-7B-Instruct (hermes format): text, then one <tool_call> block per call; an escaped quote and a
# brace inside a JSON string.
HERMES = ('I will check the weather in both cities.\n<tool_call>\n{"name": "get_weather", "arguments": '
          '{"city": "Paris", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": '
          '{"city": "Tokyo \\"JP\\" {x}", "unit": "celsius"}}\n</tool_call>')
HERMES_CALLS = [("get_weather", '{"city": "Paris", "unit": "celsius"}'),
                ("get_weather", '{"city": "Tokyo \\"JP\\" {x}", "unit": "celsius"}')]
HERMES_CONTENT = "I will check the weather in both cities.\n"
# Llama-3.1-8B-Instruct with its JSON tool prompt: the output is the call(s), `parameters` for arguments.
LLAMA3 = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "San Francisco, CA"}}; '
          '{"name": "get_time", "parameters": {"timezone": "America/Los_Angeles"}}')
LLAMA3_CALLS = [("get_weather", '{"city": "San Francisco, CA"}'),
                ("get_time", '{"timezone": "America/Los_Angeles"}')]
# Mistral-7B-Instruct-v0.3: [TOOL_CALLS] (a control token, decoded with special tokens) then a JSON list.
MISTRAL = ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
           '{"name": "add", "arguments": {"a": 1, "b": [2, {"c": "]}"}]}}]')
MISTRAL_CALLS = [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("add", '{"a": 1, "b": [2, {"c": "]}"}]}')]
PLAIN = "The weather in Paris is usually mild in spring; I cannot look it up right now."
# max_tokens cut the call's JSON: not a call, the text stays content
HERMES_CUT = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'

CASES = [("hermes", HERMES, HERMES_CONTENT, HERMES_CALLS), ("llama3_json", LLAMA3, "", LLAMA3_CALLS),
         ("mistral", MISTRAL, "", MISTRAL_CALLS), ("hermes", PLAIN, PLAIN, []), ("llama3_json", PLAIN, PLAIN, []),
         ("mistral", PLAIN, PLAIN, []), ("hermes", HERMES_CUT, HERMES_CUT, [])]


def stream_pieces(parser, text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]], list[str]]:
    """(content, [(name, arguments)], ids) joined from a stream's deltas as an OpenAI client joins them."""
    stream = ToolCallStream(parser)
    content, calls = "", {}
    bounds = [0, *cuts, len(text)]
    pieces = [stream.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [stream.finish()]
    for piece_content, deltas in pieces:
        content += piece_content
        for delta in deltas:
            call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
            if delta.id is not None:
                assert call["id"] is None, "a call's id comes once, in its first piece"
                call["id"], call["name"] = delta.id, delta.name
            call["arguments"] += delta.arguments
    closed = [calls[i] for i in range(len(stream.calls))]
    return content, [(c["name"], c["arguments"]) for c in closed], [c["id"] for c in closed]


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_whole_and_streamed_at_every_cut(name, text, content, calls):
    parser = get_tool_parser(name)
    whole_content, whole_calls = parser.extract(text)
    assert whole_content == content and [(c.name, c.arguments) for c in whole_calls] == calls
    for call in whole_calls:
        assert isinstance(json.loads(call.arguments), dict) and call.id.startswith("call_") and len(call.id) == 29
    for cut in range(len(text) + 1):  # two pieces: the marker and every JSON string split at every character
        streamed_content, streamed_calls, ids = stream_pieces(parser, text, [cut])
        assert streamed_calls == calls, cut
        assert streamed_content == (content if calls else text), cut
        assert None not in ids
    for size in (1, 3, 7):  # many small pieces
        assert stream_pieces(parser, text, list(range(size, len(text), size)))[1] == calls


def test_parse_tool_output_ends_with_tool_calls_only_when_the_sample_stopped_itself():
    parser = get_tool_parser("hermes")
    content, calls, finish = parse_tool_output(parser, HERMES, "stop")
    assert content == HERMES_CONTENT.strip() and len(calls) == 2 and finish == "tool_calls"
    assert calls[0].to_openai() == {"id": calls[0].id, "type": "function",
                                    "function": {"name": "get_weather", "arguments": HERMES_CALLS[0][1]}}
    assert parse_tool_output(parser, HERMES, "length")[2] == "length"
    assert parse_tool_output(parser, PLAIN, "stop") == (PLAIN, None, "stop")


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}


@pytest.mark.parametrize("tools, choice, field", [
    ([{"type": "function", "function": {"description": "no name"}}], None, "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "bad name!"}}], None, "tools[0].function.name"),
    ([WEATHER, {"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}], None,
     "tools[1].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": 3}}}], None,
     "tools[0].function.parameters"),
    ([{"type": "retrieval"}], None, "tools[0].type"),
    ([WEATHER, WEATHER], None, "tools[1].function.name"),
    ([WEATHER], {"type": "function", "function": {"name": "get_time"}}, "tool_choice.function.name"),
    ([WEATHER], "sometimes", "tool_choice"),
    (None, "required", "tool_choice"),
])
def test_bad_tools_name_the_field(tools, choice, field):
    with pytest.raises(ToolsError) as caught:
        check_tool_choice(choice, check_tools(tools) if tools is not None else None)
    assert caught.value.field == field


def test_tool_choice_values():
    tools = check_tools([WEATHER])
    assert check_tool_choice(None, tools).choice == "auto" and check_tool_choice(None, None) is None
    assert check_tool_choice("none", tools).is_parsed is False
    named = check_tool_choice({"type": "function", "function": {"name": "get_weather"}}, tools)
    assert named.choice == "named" and named.name == "get_weather" and named.is_forced
    assert check_tool_choice("required", tools, parallel_tool_calls=False).is_parallel is False


def test_unknown_parser_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown tool call parser 'json'; known: hermes, llama3_json, mistral"):
        get_tool_parser("json")
