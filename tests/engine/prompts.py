"""Test prompts for the engine tests on the real model, several built to an exact token count."""

from __future__ import annotations


def chat(user: str, system: str | None = None) -> list[dict]:
    """One user turn; system None keeps SmolLM2's default system prompt, "" replaces it with nothing."""
    messages = [] if system is None else [{"role": "system", "content": system}]
    return messages + [{"role": "user", "content": user}]


# Chat prompts whose token counts (checked in test_hf_parity) straddle block boundaries at 16 and 32.
BOUNDARY_CHATS = {
    15: chat("Hi", system=""),
    16: chat("Hi there", system=""),
    17: chat("Hi", system="Brief."),
    31: chat("Hi"),
    32: chat("Hi there"),
    33: chat("Hi there!"),
}

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "What is 12 times 7?",
    "Translate 'good morning' into Spanish.",
    "Give me one tip for learning Python.",
    "Who wrote Romeo and Juliet?",
    "What color is the sky on a clear day?",
    "Name a planet in our solar system.",
    "Describe a cat in five words.",
    "What is the boiling point of water?",
    "Suggest a name for a pet goldfish.",
    "How many days are in a leap year?",
    "Why do leaves change color in autumn?",
]

# 119 tokens with the chat template: longer than the 64-token step budget of the chunked-prefill engine.
LONG_CHAT = chat(
    "Here are my notes from a long planning meeting. We discussed moving the weekly sync to Thursday "
    "afternoons, hiring two more data engineers before the end of the quarter, migrating the nightly "
    "evaluation jobs to the new cluster, cleaning up the old parquet shards that nobody reads anymore, "
    "and writing better documentation for the batch generation pipeline so new team members can run it "
    "without help. Please summarize these notes as a short list of action items.")

# 22 chat prompts: the boundary ones, everyday questions, and the long one (last).
CHAT_PROMPTS = list(BOUNDARY_CHATS.values()) + [chat(q) for q in QUESTIONS] + [LONG_CHAT]
LONG_INDEX = len(CHAT_PROMPTS) - 1

EXTRA_QUESTIONS = [
    "What is the largest ocean on Earth?",
    "Give an example of a renewable energy source.",
    "How do bees make honey?",
    "What does a thermometer measure?",
    "Name two musical instruments with strings.",
    "What is the opposite of 'ancient'?",
    "Recommend a short book for a train ride.",
    "How many legs does a spider have?",
    "What is a synonym for 'happy'?",
    "Why is exercise good for you?",
]
# 32 prompts for batch invariance.
INVARIANCE_PROMPTS = CHAT_PROMPTS + [chat(q) for q in EXTRA_QUESTIONS]
