"""Prompts that share a long system prompt (the prefix-caching tests, engine and pipeline level)."""

from __future__ import annotations

import os

BLOCK_SIZE = 16
# 312 tokens; with SmolLM2's chat template the prompts built below share their first 320 tokens.
SYSTEM = (
    "You are a careful, friendly assistant for a busy data team. Always follow these rules in every "
    "single answer. " + " ".join(
        f"Rule {i}: keep answer number {i} short, factual and polite, and never invent sources."
        for i in range(1, 15))
)
NUM_SHARED_TOKENS = 320
# A second, shorter system prompt whose requests push the first one's blocks out of a small pool.
OTHER_SYSTEM = "You are a terse math tutor. " + " ".join(
    f"Step {i}: check the arithmetic twice." for i in range(1, 12))
_WORDS = ["red", "blue", "green", "gold", "grey", "pink", "teal", "navy"]


def chat(user: str, system: str = SYSTEM) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def user_message(i: int) -> str:
    """Short, distinct user messages: the prompts share nothing past the system prompt's header."""
    return f"{_WORDS[i % len(_WORDS)].title()} {i // len(_WORDS)}?"


def shared_prefix_blocks_tokens(prompt_token_ids: list[list[int]]) -> int:
    """The prompts' common prefix, rounded down to whole KV blocks: what a cache hit can cover."""
    return len(os.path.commonprefix(prompt_token_ids)) // BLOCK_SIZE * BLOCK_SIZE
