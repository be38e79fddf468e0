"""Tools as OpenAI's chat API sends them: checked, rendered through the chat template, forced, parsed.

Shared by `LLM.chat(tools=..., tool_choice=...)`, the server's chat requests and batch lines, and
jobs' tools (a column or the job's own). A bad value is a ToolsError naming the field
(`tools[0].function.name`, `tool_choice`), which each caller reports its way (a 400, an error row).

tool_choice (OpenAI's): `none` (the model answers in text; the tools are still in the prompt, as
vLLM renders them), `auto` (the model may call; calls are parsed from its text by the tool-call
parser), `required` (at least one call, forced), or `{"type": "function", "function": {"name": N}}`
(exactly one call of N, forced). Forced calls are written in the parser's own format through a
grammar whose arguments are the tool's parameters schema (ToolParser.forced_grammar), so they always
parse and validate.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")  # OpenAI's function names: 1-64 of a-z, A-Z, 0-9, _ and -
TOOL_CHOICES = ("none", "auto", "required")


class ToolsError(ValueError):
    """`field`: the request field at fault (`tools[1].function.parameters`, `tool_choice`)."""

    def __init__(self, field_name: str, reason: str):
        super().__init__(f"{field_name}: {reason}")
        self.field = field_name
        self.reason = reason


@dataclass(frozen=True)
class ToolRequest:
    """A request's checked tools and its choice: `choice` is none | auto | required | named, `name`
    the named function."""

    tools: list[dict]
    choice: str = "auto"
    name: str | None = None
    is_parallel: bool = True

    @property
    def is_forced(self) -> bool:
        return self.choice in ("required", "named")

    @property
    def is_parsed(self) -> bool:
        """Whether the output is read for calls (not with tool_choice none)."""
        return self.choice != "none"


def check_tools(tools: Any, field_name: str = "tools") -> list[dict]:
    """The tools, each {"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}."""
    if not isinstance(tools, list):
        raise ToolsError(field_name, f"must be a list of tools; got {type(tools).__name__}")
    names = set()
    for i, tool in enumerate(tools):
        where = f"{field_name}[{i}]"
        if not isinstance(tool, dict):
            raise ToolsError(where, "must be an object {type: function, function: {...}}")
        if tool.get("type", "function") != "function":
            raise ToolsError(f"{where}.type", f"must be function; got {tool.get('type')!r}")
        unknown = sorted(set(tool) - {"type", "function"})
        if unknown:
            raise ToolsError(f"{where}.{unknown[0]}", "unknown field")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ToolsError(f"{where}.function", "is required (an object with a name)")
        unknown = sorted(set(function) - {"name", "description", "parameters", "strict"})
        if unknown:
            raise ToolsError(f"{where}.function.{unknown[0]}", "unknown field")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ToolsError(f"{where}.function.name", f"is required: 1-64 letters, digits, _, . or -; got {name!r}")
        if name in names:
            raise ToolsError(f"{where}.function.name", f"{name!r} names two tools")
        names.add(name)
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise ToolsError(f"{where}.function.description", "must be a string")
        if "parameters" in function and function["parameters"] is not None:
            _check_schema(function["parameters"], f"{where}.function.parameters")
    return [{"type": "function", "function": dict(t["function"])} for t in tools]


def _check_schema(schema: Any, where: str) -> None:
    if not isinstance(schema, dict):
        raise ToolsError(where, f"must be a JSON schema object; got {type(schema).__name__}")
    if schema.get("type", "object") != "object":
        raise ToolsError(where, f"must be a schema of an object (type: object); got type {schema.get('type')!r}")
    try:
        from jsonschema import Draft202012Validator, SchemaError
    except ImportError:  # the grammar library refuses what it cannot use when a call is forced
        return
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        raise ToolsError(where, f"is not a valid JSON schema: {exc.message}") from None


def check_tool_choice(choice: Any, tools: list[dict] | None, parallel_tool_calls: bool | None = None,
                      field_name: str = "tool_choice") -> ToolRequest | None:
    """The request's ToolRequest (None: no tools and no choice that needs one)."""
    if choice is None:
        choice = "auto" if tools else "none"
    name = None
    if isinstance(choice, dict):
        function = choice.get("function")
        if choice.get("type") != "function" or not isinstance(function, dict) or \
                not isinstance(function.get("name"), str) or set(choice) - {"type", "function"}:
            raise ToolsError(field_name, "must be none, auto, required or {\"type\": \"function\", \"function\": "
                                         "{\"name\": ...}}")
        name = function["name"]
        if name not in {t["function"]["name"] for t in tools or []}:
            given = ", ".join(t["function"]["name"] for t in tools or []) or "none"
            raise ToolsError(f"{field_name}.function.name", f"names {name!r}, which is not among the tools "
                                                            f"given ({given})")
        choice = "named"
    elif choice not in TOOL_CHOICES:
        raise ToolsError(field_name, f"must be none, auto, required or a named function; got {choice!r}")
    if choice in ("auto", "required") and not tools:
        raise ToolsError(field_name, f"{choice} needs tools")
    if not tools:
        return None
    return ToolRequest(tools, choice, name, parallel_tool_calls is not False)


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates expect them (vLLM's rule): an assistant's tool_calls' arguments as
    objects, not JSON text."""
    import json

    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = dict(message)
            fixed = []
            for call in calls:
                function = dict(call.get("function") or {})
                if isinstance(function.get("arguments"), str):
                    try:
                        function["arguments"] = json.loads(function["arguments"])
                    except json.JSONDecodeError:
                        pass
                fixed.append({**call, "function": function})
            message["tool_calls"] = fixed
        out.append(message)
    return out


def forced_constraint(parser, request: ToolRequest):
    """The StructuredOutputsParams that makes the model write the calls `request` forces (None: not forced)."""
    if not request.is_forced:
        return None
    from batchgen.engine.decoding.structured.params import StructuredOutputsParams

    return StructuredOutputsParams(grammar=parser.forced_grammar(request.tools, request.name, request.is_parallel))


def parse_tool_output(parser, content: str, finish_reason: str | None):
    """(content less the calls, the calls (ToolCalls) or None, the finish reason: tool_calls where the
    sample ended by itself with calls)."""
    text, calls = parser.extract(content)
    if not calls:
        return content, None, finish_reason
    return text.strip(), calls, "tool_calls" if finish_reason == "stop" else finish_reason
