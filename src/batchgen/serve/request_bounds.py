"""What one request may cost the server, checked before the work it would bring is done.

- Size before parse: a prompt of B bytes holds at least B / (the tokenizer's longest token in bytes)
  tokens, so text longer than max_model_len x that can never fit the context. A chat body whose byte
  length alone passes that bound (with room for JSON escapes and the non-prompt fields) is refused
  before it is read in full, parsed or tokenized; a completion's text prompts, before tokenizing.
- Sequences: a request holds prompts x max(n, beam width) sequences; the server's bound on them is
  --max-queued-sequences.
- Echoed log-probabilities: a prompt's log-probability entries (tokens x (1 + top N)) are capped, each
  being ~100 bytes of JSON made on the engine thread.
"""

from __future__ import annotations

from batchgen.engine import SamplingParams
from batchgen.openai.api_error import APIError, bad_request

# A character written as a JSON escape takes up to 6 bytes (\u0001) for its 1 byte of text.
JSON_ESCAPE_FACTOR = 6
# Room in a chat body for what is not prompt text: a response_format schema, logit_bias, stop lists.
NON_PROMPT_BYTES = 2 << 20
MAX_PROMPT_LOGPROB_ENTRIES = 32_768  # ~3 MB of JSON per prompt (a 7k-token echo with 20 alternatives was 13.9 MB)


def max_prompt_bytes(max_model_len: int, max_token_bytes: int) -> int:
    """The longest prompt text (UTF-8 bytes) that could fit `max_model_len` tokens."""
    return max_model_len * max_token_bytes


def max_chat_body_bytes(prompt_bytes: int) -> int:
    """The largest chat body that could hold a prompt of at most `prompt_bytes` bytes of text."""
    return prompt_bytes * JSON_ESCAPE_FACTOR + NON_PROMPT_BYTES


def chat_body_too_large(num_bytes: int | None, max_bytes: int, max_model_len: int) -> APIError:
    size = f"{num_bytes:,} bytes" if num_bytes is not None else f"over {max_bytes:,} bytes"
    return APIError(400, f"the request body is {size}: more text than this model's maximum context length of "
                         f"{max_model_len} tokens could hold (at most {max_bytes:,} bytes for a chat request "
                         "to this model)", "messages", "context_length_exceeded",
                    headers={"Connection": "close"})


def check_prompt_bytes(prompt: str, field: str, max_bytes: int, max_model_len: int) -> None:
    """400 when a text prompt is longer than any prompt of max_model_len tokens (before tokenizing it)."""
    if len(prompt) * 4 <= max_bytes:  # 4 bytes per character at most: no need to encode it
        return
    num_bytes = len(prompt.encode("utf-8", "surrogatepass"))
    if num_bytes > max_bytes:
        raise bad_request(f"this model's maximum context length is {max_model_len} tokens; the {field} has "
                          f"{num_bytes:,} bytes of text, more than that many tokens can hold ({max_bytes:,})",
                          field, "context_length_exceeded")


def messages_text(messages: list[dict]) -> str:
    """Every string in chat messages (content, text parts, names) joined: what the prompt's text holds at least."""
    pieces: list[str] = []

    def walk(value) -> None:
        if isinstance(value, str):
            pieces.append(value)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)
    walk(messages)
    return "".join(pieces)


def num_sequences(params: SamplingParams, num_prompts: int) -> int:
    """The sequences a request holds in the engine: each prompt's samples or beams."""
    return num_prompts * max(params.n, params.beam_width)


def check_prompt_logprob_entries(num_tokens: int, num_top: int | None, field: str) -> None:
    """400 when a prompt's echoed log-probabilities would pass MAX_PROMPT_LOGPROB_ENTRIES."""
    if num_top is None:
        return
    num_entries = num_tokens * (1 + num_top)
    if num_entries > MAX_PROMPT_LOGPROB_ENTRIES:
        raise bad_request(f"the prompt's log-probabilities would be {num_entries:,} entries ({num_tokens} tokens x "
                          f"{1 + num_top}); at most {MAX_PROMPT_LOGPROB_ENTRIES:,} per prompt are returned: ask "
                          "fewer top log-probabilities or send a shorter prompt", field)
