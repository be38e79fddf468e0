"""Incremental text of one sample while it is generated, for streaming.

Each step decodes only a short window of tokens (the read offsets of vLLM's and TGI's incremental
detokenizers), so a long stream costs O(tokens), not O(tokens^2). Text is held back while it ends in
an incomplete UTF-8 sequence (U+FFFD), and by one character less than the longest stop string, so
nothing streamed is ever cut away later when a stop string completes; the sample's final text
(the engine's) supplies the rest.
"""

from __future__ import annotations

from collections.abc import Callable


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stop: list[str]):
        self.decode = decode
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.prefix_offset = 0  # tokens before this are decoded for good
        self.read_offset = 0  # tokens before this are in `text`
        self.text = ""
        self.num_sent_chars = 0
        self.num_sent_tokens = 0

    def advance(self, token_ids: list[int]) -> str:
        """The new text to stream after `token_ids` (every output token so far); may be empty."""
        if len(token_ids) > self.read_offset:
            before = self.decode(token_ids[self.prefix_offset:self.read_offset])
            after = self.decode(token_ids[self.prefix_offset:])
            if len(after) > len(before) and not after.endswith("\ufffd"):
                self.text += after[len(before):]
                self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        visible = len(self.text) - self.holdback
        if visible <= self.num_sent_chars:
            return ""
        delta = self.text[self.num_sent_chars:visible]
        self.num_sent_chars = visible
        return delta

    def finish(self, final_text: str) -> str:
        """What is left to stream once the engine's final text is known."""
        delta = final_text[self.num_sent_chars:]
        self.num_sent_chars = len(final_text)
        return delta

    def take_tokens(self, num_tokens: int) -> tuple[int, int]:
        """The [start, end) token range not yet streamed, marked as streamed."""
        start, self.num_sent_tokens = self.num_sent_tokens, max(self.num_sent_tokens, num_tokens)
        return start, self.num_sent_tokens
