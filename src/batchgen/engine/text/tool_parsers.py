"""Tool-call parsers (vLLM's `--tool-call-parser NAME`): a model's tool calls read from its text, and
the grammar that makes it write them (tool_choice `required` or a named function).

Each format is a marker that opens the calls, then JSON objects {name, arguments} in a wrapper:
- `hermes` (Qwen2.5/Qwen3, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one
  block per call; the text before the first block is the answer's content.
- `llama3_json` (Llama 3.1+): the output is `{"name": ..., "parameters": {...}}` (after an optional
  `<|python_tag|>`), several separated by `; `.
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (the tokenizer's control token:
  outputs keep special tokens when this parser reads them).

`ToolCallStream` reads one sample's text whole or in pieces (a stream's deltas, cut anywhere, inside
the marker or a JSON string too) with one scanner, so a stream's pieces join into exactly the whole
sample's calls: each call's `arguments` is the model's own JSON text of the arguments object. A call
whose JSON does not close (max_tokens cut it) is not a call; when no call closes, the whole text is
the content (as vLLM answers an output it cannot parse).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

_DECODER = json.JSONDecoder()
_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


def new_call_id() -> str:
    """An OpenAI-style tool call id: call_ and 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    """One parsed call: its id, the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolCallDelta:
    """A streamed piece of call `index`: the first carries id and name, later ones argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict:
        body: dict = {"index": self.index}
        if self.id is not None:
            body.update(id=self.id, type="function")
        function = {}
        if self.name is not None:
            function["name"] = self.name
        if self.name is not None or self.arguments:
            function["arguments"] = self.arguments
        body["function"] = function
        return body


@dataclass(frozen=True)
class ToolParser:
    """A format: `marker` opens the calls (empty: the output itself starts with the first call's
    JSON); `args_key` is the arguments' key it writes; `prefix`/`separator`/`suffix` wrap the calls
    in the forced grammar. `keeps_special_tokens`: the marker is a control token, so outputs it reads
    are decoded with special tokens."""

    name: str
    marker: str
    args_key: str = "arguments"
    call_open: str = ""  # before each call's JSON in the forced grammar
    call_close: str = ""  # after it
    separator: str = ""  # between two calls
    prefix: str = ""  # before the first call (after the marker)
    suffix: str = ""  # after the last call
    optional_markers: tuple[str, ...] = ()  # may precede the calls (llama3's <|python_tag|>)
    keeps_special_tokens: bool = False

    def extract(self, text: str) -> tuple[str, list[ToolCall]]:
        """(the content, the calls) of a whole sample's text."""
        stream = ToolCallStream(self)
        content, _ = stream.feed(text)
        rest, _ = stream.finish()
        return content + rest, stream.calls

    def forced_grammar(self, tools: list[dict], name: str | None = None, is_parallel: bool = True) -> str:
        """A Lark grammar (llguidance's, with %json) of this format's calls: one call of `name`, or one
        or more (one with is_parallel false) of any of `tools`, each arguments object valid against its
        tool's parameters schema (objects closed to unnamed properties)."""
        from batchgen.engine.decoding.structured.strict_schema import close_objects

        chosen = [t for t in tools if name is None or t["function"]["name"] == name]
        branches = []
        for tool in chosen:
            function = tool["function"]
            parameters = close_objects(function.get("parameters") or {"type": "object", "properties": {}})
            branches.append({"type": "object", "properties": {"name": {"const": function["name"]},
                                                              self.args_key: parameters},
                             "required": ["name", self.args_key], "additionalProperties": False})
        schema = {"anyOf": branches} if len(branches) > 1 else branches[0]
        schema["x-guidance"] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        calls = "call" if name is not None or not is_parallel else f"call ({json.dumps(self.separator)} call)*"
        head = json.dumps(self.marker + self.prefix) + " " if self.marker + self.prefix else ""
        tail = " " + json.dumps(self.suffix) if self.suffix else ""
        call = " ".join(part for part in (json.dumps(self.call_open) if self.call_open else "", "obj",
                                          json.dumps(self.call_close) if self.call_close else "") if part)
        return f"start: {head}{calls}{tail}\ncall: {call}\nobj: %json {json.dumps(schema)}\n"


_PARSERS: dict[str, ToolParser] = {}


def register_tool_parser(parser: ToolParser) -> None:
    """Add a parser under its name (vLLM's ToolParserManager.register_module)."""
    _PARSERS[parser.name] = parser


def tool_parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered as `name`; ValueError listing the known ones otherwise."""
    parser = _PARSERS.get(name)
    if parser is None:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(tool_parser_names())}")
    return parser


register_tool_parser(ToolParser("hermes", "<tool_call>", call_close="\n</tool_call>",
                                separator="\n<tool_call>\n", prefix="\n"))
register_tool_parser(ToolParser("llama3_json", "", args_key="parameters", separator="; ",
                                optional_markers=("<|python_tag|>",)))
register_tool_parser(ToolParser("mistral", "[TOOL_CALLS]", prefix="[", separator=", ", suffix="]",
                                keeps_special_tokens=True))


def _held_back(text: str, tag: str) -> int:
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ToolCallStream:
    """One sample's text through a tool parser, piece by piece: `feed(delta)` -> (content text, call
    deltas) certain now; `finish()` -> the rest. `calls`: the calls whose JSON closed, in order."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.mode = "start"  # "start" (the marker may come), "content", "calls"
        self.buffer = ""  # text not yet given out (content mode) or the calls region (calls mode)
        self.calls: list[ToolCall] = []
        self.pos = 0  # calls mode: where the next call's JSON is looked for in buffer
        self.current: ToolCall | None = None  # the call being streamed (its header sent)
        self.args_start = -1  # where its arguments' JSON starts in buffer
        self.num_args_sent = 0

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        self.buffer += delta
        content = ""
        if self.mode == "start":
            content += self._start()
        if self.mode == "content":
            content += self._content()
        deltas = self._scan() if self.mode == "calls" else []
        return content, deltas

    def _start(self) -> str:
        """Decide whether the output opens with the calls (a format with no marker: its first JSON)."""
        parser = self.parser
        if parser.marker:
            self.mode = "content"
            return ""
        head = self.buffer.lstrip()
        for optional in parser.optional_markers:
            if head.startswith(optional):
                head = head[len(optional):].lstrip()
            elif optional.startswith(head):
                return ""  # undecided
        if not head:
            return ""
        if head.startswith("{"):
            self.mode, self.buffer = "calls", head
        else:
            self.mode = "content"
        return ""

    def _content(self) -> str:
        marker = self.parser.marker
        at = self.buffer.find(marker) if marker else -1
        if at >= 0:
            text, self.buffer = self.buffer[:at], self.buffer[at + len(marker):]
            self.mode = "calls"
            return text
        keep = _held_back(self.buffer, marker) if marker else 0
        text, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
        return text

    def _scan(self) -> list[ToolCallDelta]:
        deltas = []
        while True:
            if self.current is None:
                start = self.buffer.find("{", self.pos)
                if start < 0:
                    return deltas
                self.pos = start
                body = self.buffer[start:]
                name = _NAME.search(body)
                args = _ARGS.search(body)
                if name is None or args is None or args.end() >= len(body):
                    if _complete(body) is not None:  # a closed object without a call's fields: skip it
                        self.pos = start + _complete(body)
                        continue
                    return deltas
                try:
                    call_name = json.loads(f'"{name.group(1)}"')
                except json.JSONDecodeError:
                    return deltas
                self.current = ToolCall(call_name, "")
                self.args_start, self.num_args_sent = start + args.end(), 0
                deltas.append(ToolCallDelta(len(self.calls), self.current.id, call_name))
            args_text = self.buffer[self.args_start:]
            end = _complete(args_text)
            if end is None:  # the arguments go on: all of it so far is theirs
                new = args_text[self.num_args_sent:]
                if new:
                    deltas.append(ToolCallDelta(len(self.calls), arguments=new))
                    self.num_args_sent = len(args_text)
                return deltas
            new = args_text[self.num_args_sent:end]
            if new:
                deltas.append(ToolCallDelta(len(self.calls), arguments=new))
            object_end = _complete(self.buffer[self.pos:])
            if object_end is None:  # the call's object has not closed yet (its `}` comes)
                self.num_args_sent = end
                return deltas
            self.current.arguments = args_text[:end]
            self.calls.append(self.current)
            self.current, self.pos = None, self.pos + object_end

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """What is left: in content mode the held-back text; with no call closed, the calls region was
        content after all (not streamed as calls, so only non-streamed outputs get it back)."""
        if self.mode == "start":
            self.mode = "content"
        if self.mode == "content":
            rest, self.buffer = self.buffer, ""
            return rest, []
        if not self.calls:
            rest = (self.parser.marker + self.buffer) if self.parser.marker else self.buffer
            return rest, []
        return "", []


def _complete(text: str) -> int | None:
    """The end of the JSON value `text` starts with (after whitespace), or None while it is unclosed."""
    stripped = text.lstrip()
    offset = len(text) - len(stripped)
    if not stripped:
        return None
    try:
        _, end = _DECODER.raw_decode(stripped)
    except json.JSONDecodeError:
        return None
    return offset + end
