"""How chat messages become a prompt: which template renders them and with what (vLLM's names).

`ChatTemplateOptions` travels with a conversation from `LLM.chat`, a server request or a job row to
the tokenizer (engine/text/tokenizer.py renders it). `load_chat_template` reads a template given the way
vLLM's `--chat-template` takes one: a file path, or the template text itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The arguments of transformers' apply_chat_template (and the variable holding the conversation):
# a template kwarg with one of these names would clash with the call itself rather than reach the
# template. tests/engine/text/test_chat_api.py checks the list against the installed transformers.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})
# A value without any of these characters cannot be a template (it prints nothing but itself): it is a path.
_TEMPLATE_MARKS = ("{", "}", "\n")
# What a template is tried on before any real conversation reaches it.
PROBE_CONVERSATION = ({"role": "user", "content": "Hello"},)


@dataclass(frozen=True)
class ChatTemplateOptions:
    """`chat_template`: the template's text (None: the model's own). `add_generation_prompt`: end
    with the assistant's turn header. `continue_final_message`: leave the last (assistant) message
    open so the completion continues it. `chat_template_kwargs`: extra template variables (e.g.
    `enable_thinking: false`)."""

    chat_template: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    tools: list[dict] | None = None

    def __post_init__(self) -> None:
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("continue_final_message needs add_generation_prompt false: the final message is "
                             "continued, so no new assistant turn is started")
        kwargs = self.chat_template_kwargs
        if kwargs is None:
            object.__setattr__(self, "chat_template_kwargs", {})
        elif not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
            raise ValueError(f"chat_template_kwargs must be a mapping of variable names to values; got {kwargs!r}")
        clashing = sorted(set(self.chat_template_kwargs) & RESERVED_TEMPLATE_KWARGS)
        if clashing:
            raise ValueError(f"chat_template_kwargs cannot set {', '.join(clashing)}: "
                             "they are arguments of the template call, not template variables")

    def check_messages(self, messages: list[dict]) -> None:
        if self.continue_final_message and (not messages or messages[-1].get("role") != "assistant"):
            raise ValueError("continue_final_message needs the last message to be the assistant's (the text "
                             "to continue)")


DEFAULT_CHAT = ChatTemplateOptions()


def load_chat_template(value: str, base_dir: Path | None = None) -> str:
    """The template text of `value`: the file it names (relative to `base_dir` when given), or `value`
    itself when it holds template syntax ('{', '}' or a newline). ValueError for an unreadable file."""
    if any(mark in value for mark in _TEMPLATE_MARKS):
        return value
    path = Path(value).expanduser()
    if base_dir is not None and not path.is_absolute():
        path = base_dir / path
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ValueError(f"chat template {value!r} looks like a file path, but {path} cannot be read "
                         f"({reason}); give a template file or the template text itself") from None


def check_template_syntax(template: str) -> None:
    """ValueError naming the line when the template does not parse (checked before any model loads)."""
    import jinja2

    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"the chat template does not parse: line {exc.lineno}: {exc.message}") from None
