"""A request's prompt -> token ids: small prompts on the engine thread, large ones on a thread of their own.

Encoding a prompt of megabytes takes seconds (a 9 MB chat: 10-25 s on a busy CPU core). On the
engine thread it would stop every other request's steps that long; on the event loop, every HTTP
request. Prompts of LARGE_PROMPT_BYTES or more are encoded by PromptEncoder instead: one worker
thread (large prompts wait for each other, never a small one) with its own copy of the tokenizer (a
Rust tokenizer must not serve two threads at once), encoding in the Rust backend with the GIL
released (engine/text/backend_encode.py), so the engine thread and the event loop keep running. Small
prompts, nearly all of them, are still encoded by the engine thread between two steps: a few
kilobytes cost it well under a millisecond.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from batchgen.engine.text.chat_template import DEFAULT_CHAT, ChatTemplateOptions
from batchgen.engine.text.tokenizer import Tokenizer
from batchgen.openai.api_error import bad_request

# ~4k tokens of text: a few milliseconds of encoding on the engine thread; above, the encoder's thread.
LARGE_PROMPT_BYTES = 16 << 10

Prompt = str | list[dict] | list[int]


def is_token_ids(prompt: Prompt) -> bool:
    return isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)


def is_large(prompt: Prompt) -> bool:
    """A text prompt (or chat) of LARGE_PROMPT_BYTES or more characters; token ids never are (they
    need no encoding, and their length is checked before anything walks them)."""
    if isinstance(prompt, str):
        return len(prompt) >= LARGE_PROMPT_BYTES
    if is_token_ids(prompt):
        return False
    return sum(len(m.get("content") or "") for m in prompt) >= LARGE_PROMPT_BYTES


def encode_prompt(tokenizer: Tokenizer, prompt: str | list[dict], prompt_field: str,
                  chat: ChatTemplateOptions = DEFAULT_CHAT) -> list[int]:
    """The prompt's token ids (messages rendered as `chat` says), or a 400 naming `prompt_field` (no
    chat template, a template error).

    Control-token text in message content is text (as in jobs); a raw prompt is the caller's own
    template, as in vLLM."""
    try:
        return tokenizer.encode_prompt(prompt, allow_special_tokens=isinstance(prompt, str), options=chat)
    except ValueError as exc:  # no chat template
        raise bad_request(str(exc), prompt_field) from None
    except Exception as exc:  # the template raised (a role it refuses, ...): this request's problem
        raise bad_request(f"cannot apply the chat template: {type(exc).__name__}: {exc}", prompt_field,
                          "invalid_template_input") from None


class PromptEncoder:
    """Encodes large prompts on its own thread with its own tokenizer."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer.copy()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="batchgen-encode")

    async def encode(self, prompt: str | list[dict], prompt_field: str,
                     chat: ChatTemplateOptions = DEFAULT_CHAT) -> list[int]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, encode_prompt, self._tokenizer, prompt,
                                          prompt_field, chat)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
