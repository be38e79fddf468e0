"""Stop strings checked on the new text only: each step decodes a sequence's newest tokens, not its
whole output (vLLM's incremental detokenization). A stop string counts when it ends in text not yet
checked; text made before min_tokens is marked checked without a search (output_processor.py's
stop rules). The same incremental text is what a streamed output's text deltas come from."""

from __future__ import annotations

from collections.abc import Callable


class IncrementalText:
    """A sequence's output text so far, extended each step by decoding a short window of tokens.

    The window starts at the previous step's tokens (`prefix_offset`) so a token whose text depends
    on its left neighbour (a leading space, a merge) decodes as it does in the whole output; text
    ending in U+FFFD (an incomplete UTF-8 character) waits for the next token.
    """

    __slots__ = ("text", "prefix_offset", "read_offset", "num_checked_chars", "stop_text")

    def __init__(self):
        self.text = ""
        self.prefix_offset = 0  # output token where the decode window starts
        self.read_offset = 0  # output tokens already in `text`
        self.num_checked_chars = 0  # text already searched for stop strings, or made before min_tokens
        self.stop_text: str | None = None  # the output's final text, cut where a stop string ended it

    def update(self, decode: Callable[[list[int]], str], token_ids: list[int], first_output: int,
               end: int | None = None) -> None:
        """`token_ids[first_output:end]` are the output tokens (`end`: past the last one whose id is
        known, default all); decode the ones not in `text` yet."""
        end = len(token_ids) if end is None else end
        num_output = end - first_output
        if num_output <= self.read_offset:
            return
        start = first_output + self.prefix_offset
        prefix_text = decode(token_ids[start:first_output + self.read_offset]) if self.read_offset > self.prefix_offset else ""
        window_text = decode(token_ids[start:end])
        if len(window_text) > len(prefix_text) and not window_text.endswith("\ufffd"):
            self.text += window_text[len(prefix_text):]
            self.prefix_offset, self.read_offset = self.read_offset, num_output


def stop_holdback(stop: list[str]) -> int:
    """Characters a streamed text holds back: one less than the longest stop string (0 without), so no
    text sent is cut away when a stop string completes later."""
    return max((len(s) for s in stop), default=1) - 1


def find_stop_string(text: str, stops: list[str], start: int) -> tuple[int, str] | None:
    """(index, stop string) of the earliest stop string in `text` that ends after `start`; None if none."""
    best: tuple[int, str] | None = None
    for stop in stops:
        i = text.find(stop, max(0, start - len(stop) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, stop)
    return best
