"""task: loglikelihood: a row's context and continuations as token ids, split as lm-evaluation-harness
splits them (the engine's `encode_continuations`: context + continuation encoded as one text, the
continuation's tokens being what follows the context's own token count).

The context is the row's prompt as generation would send it: raw text, or the chat template's rendering
of its messages (which ends where the assistant's answer starts). The continuation is plain text after it.
"""

from __future__ import annotations

from batchgen.engine.decoding.score_group import encode_continuations
from batchgen.engine.text.chat_template import DEFAULT_CHAT, ChatTemplateOptions


def encode_scored(tokenizer, prompt: str | list[dict], continuations: list[str], allow_special_tokens: bool,
                  chat: ChatTemplateOptions = DEFAULT_CHAT) -> tuple[list[int], list[list[int]]]:
    """(context token ids, each continuation's token ids); messages rendered as `chat` says (the job's
    input.chat_template and chat_template_kwargs). ValueError (the row's error) for a continuation
    that tokenizes to nothing after its context, or that holds control-token text when special tokens
    are not allowed (input.allow_special_tokens: false)."""
    if not allow_special_tokens:
        for i, text in enumerate(continuations):
            if tokenizer.control_tokens.holds_control_text(text):
                raise ValueError(f"continuations[{i}] holds control-token text (input.allow_special_tokens: false)")
    if isinstance(prompt, list):  # chat messages: the rendered template, its control tokens as such
        context_text = tokenizer.render_chat(prompt, chat)
        if not allow_special_tokens:  # the messages' own control-token text stays text, as in generation
            context_ids = tokenizer.encode_messages(prompt, allow_special_tokens=False, options=chat)
            plain_ids = tokenizer.encode(context_text, add_special_tokens=False)
            if context_ids != plain_ids:
                raise ValueError("the messages hold control-token text (input.allow_special_tokens: false); "
                                 "a scored context cannot keep it as text")

        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False)
    else:
        context_text = prompt

        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, allow_special_tokens=allow_special_tokens)
    context_ids, continuation_ids = encode_continuations(encode, context_text, continuations)
    if not context_ids:
        raise ValueError("the context has no tokens")
    for i, ids in enumerate(continuation_ids):
        if not ids:
            raise ValueError(f"continuations[{i}] has no token after the context")
    return context_ids, continuation_ids
