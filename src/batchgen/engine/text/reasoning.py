"""Reasoning parsers (vLLM's `--reasoning-parser NAME`): a model's thinking split from its answer.

A parser knows its model family's markers and whether the family thinks by default. `ReasoningStream`
runs one sample's text through it, whole or in pieces (a stream's deltas, cut anywhere, a tag too):
the same state machine either way, so a streamed sample's joined pieces equal its whole split.

- `deepseek_r1` (DeepSeek-R1 and its distills, QwQ): `<think>` ... `</think>` then the answer. The
  template opens `<think>` in the prompt, so the output may start inside the thinking without a start
  tag: without a `</think>` the whole output is reasoning (a sample cut by max_tokens while thinking).
- `qwen3` (Qwen3, with `enable_thinking` through chat_template_kwargs): the model writes `<think>` itself
  when it thinks; an output that does not start with it is all answer (enable_thinking: false renders
  an empty `<think>\\n\\n</think>` in the prompt). A prompt that ends inside an open `<think>` (the
  thinking-only Qwen3 templates) starts in the thinking, as for deepseek_r1.

The answer's leading whitespace (the newlines after `</think>`) is left out. More formats (gpt-oss's
Harmony channels) register with `register_reasoning_parser`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningParser:
    """A family's thinking markers. `is_thinking_by_default`: an output that does not open with
    `start_tag` is still thinking (its template opened the block in the prompt)."""

    name: str
    start_tag: str = "<think>"
    end_tag: str = "</think>"
    is_thinking_by_default: bool = False

    def is_opened_by_prompt(self, prompt_text: str) -> bool:
        """Whether a prompt's text leaves the thinking block open (ends with the start tag, maybe then
        whitespace): its output starts inside the thinking."""
        tail = prompt_text.rstrip()
        return tail.endswith(self.start_tag)

    def starts_thinking(self, is_opened_by_prompt: bool) -> bool | None:
        """True: the output starts inside the thinking; None: it does if it opens with start_tag."""
        return True if is_opened_by_prompt or self.is_thinking_by_default else None

    def split(self, text: str, is_opened_by_prompt: bool = False) -> tuple[str | None, str]:
        """(reasoning or None when the sample did not think, the answer) of a whole sample's text."""
        stream = ReasoningStream(self, is_opened_by_prompt)
        reasoning, content = stream.feed(text)
        last_reasoning, last_content = stream.finish()
        reasoning += last_reasoning
        return (reasoning if stream.has_thought else None), content + last_content


_PARSERS: dict[str, ReasoningParser] = {}


def register_reasoning_parser(parser: ReasoningParser) -> None:
    """Add a parser under its name (vLLM's ReasoningParserManager.register_module)."""
    _PARSERS[parser.name] = parser


def reasoning_parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser registered as `name`; ValueError listing the known ones otherwise."""
    parser = _PARSERS.get(name)
    if parser is None:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(reasoning_parser_names())}")
    return parser


register_reasoning_parser(ReasoningParser("deepseek_r1", is_thinking_by_default=True))
register_reasoning_parser(ReasoningParser("qwen3"))


def _held_back(text: str, tag: str) -> int:
    """How many characters at the end of `text` may be the start of `tag` (kept until the next piece)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ReasoningStream:
    """One sample's text through a parser, piece by piece: `feed(delta)` -> (reasoning, answer) text
    that is certain now; `finish()` -> what was held back (a partial tag at the end is text after all)."""

    def __init__(self, parser: ReasoningParser, is_opened_by_prompt: bool = False):
        self.parser = parser
        starts = parser.starts_thinking(is_opened_by_prompt)
        # "start": the first characters may still open the thinking; "think"; "answer".
        self.mode = "think" if starts else "start"
        self.has_thought = bool(starts)
        self.buffer = ""
        self.is_answer_started = False  # leading whitespace of the answer is dropped until then
        self.num_reasoning_chars = 0
        self.is_start_checked = False  # thinking from the start: a start tag at its head was looked for

    def feed(self, delta: str) -> tuple[str, str]:
        self.buffer += delta
        reasoning, content = "", ""
        while True:
            if self.mode == "start":
                head = self.buffer.lstrip()
                tag = self.parser.start_tag
                if head.startswith(tag):
                    self.buffer = head[len(tag):]
                    self.mode, self.has_thought, self.is_start_checked = "think", True, True
                    continue
                if not head or tag.startswith(head):
                    return reasoning, content  # undecided: wait for more text
                self.mode = "answer"
                continue
            if self.mode == "think":
                if not self.is_start_checked:
                    # a start tag written again after a prompt that opened the block (or by DeepSeek-R1-0528)
                    head, tag = self.buffer.lstrip(), self.parser.start_tag
                    if head.startswith(tag):
                        self.buffer = head[len(tag):]
                    elif tag.startswith(head):
                        return reasoning, content  # undecided: wait for more text
                    self.is_start_checked = True
                end = self.buffer.find(self.parser.end_tag)
                if end < 0:
                    keep = _held_back(self.buffer, self.parser.end_tag)
                    reasoning += self._reasoning(self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return reasoning, content
                reasoning += self._reasoning(self.buffer[:end])
                self.buffer = self.buffer[end + len(self.parser.end_tag):]
                self.mode = "answer"
                continue
            content += self._answer(self.buffer)
            self.buffer = ""
            return reasoning, content

    def _reasoning(self, text: str) -> str:
        self.num_reasoning_chars += len(text)
        return text

    def _answer(self, text: str) -> str:
        if not self.is_answer_started:
            text = text.lstrip()
            self.is_answer_started = bool(text)
        return text

    def finish(self) -> tuple[str, str]:
        """The held-back text: reasoning while thinking, else answer."""
        rest, self.buffer = self.buffer, ""
        if self.mode == "think":
            return self._reasoning(rest), ""
        self.mode = "answer"
        return "", self._answer(rest)

    @property
    def is_thinking(self) -> bool:
        return self.mode == "think"
