"""A tools-capable chat template for the bundled SmolLM2 (whose own template has no tools): Qwen2.5's
hermes layout (tools listed in the system turn, calls in <tool_call> blocks, tool results as
<tool_response> in a user turn; `enable_thinking` opens a <think> block as Qwen3's
thinking-only templates do), with shared tools and schemas for the LLM.chat, server and job tests."""

from __future__ import annotations

HERMES_TEMPLATE = '''
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% if not loop.last %}
{% endif %}{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}
<tool_response>
{{ message.content }}
</tool_response>{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>
{% endif %}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking %}<think>
{% endif %}{% endif %}
'''.strip("\n")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a time zone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 24}},
                   "required": ["timezone"]}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = [{"role": "user", "content": "What is the weather in Paris and the time in Tokyo?"}]


def check_calls(calls: list[dict], names: set[str] = frozenset(SCHEMAS)) -> None:
    """OpenAI tool_calls (dicts): ids, known names, JSON arguments valid against the tool's schema."""
    import json

    import jsonschema

    assert calls, "no tool calls"
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"]["name"] in names
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


def _weather_call(call_id: str, city: str) -> dict:
    import json

    return {"id": call_id, "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city, "unit": "celsius"})}}


# Two earlier turns that called the tool: greedy SmolLM2 then writes a <tool_call> itself (tool_choice auto).
FEW_SHOT_CALLS = [
    {"role": "user", "content": "What is the weather in Berlin?"},
    {"role": "assistant", "content": None, "tool_calls": [_weather_call("call_1", "Berlin")]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 12}'},
    {"role": "assistant", "content": "It is 12 degrees in Berlin."},
    {"role": "user", "content": "What is the weather in Madrid?"},
    {"role": "assistant", "content": None, "tool_calls": [_weather_call("call_2", "Madrid")]},
    {"role": "tool", "tool_call_id": "call_2", "content": '{"temperature": 25}'},
    {"role": "assistant", "content": "It is 25 degrees in Madrid."},
    {"role": "user", "content": "What is the weather in Paris?"}]
