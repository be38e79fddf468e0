"""LoRA fixtures: the test prompts and the adapter of each (A, B and the base mixed); the engine with
enable_lora (lora_llm) and the adapters (lora_adapters, lora_requests) are tests/conftest.py's."""

from __future__ import annotations

import pytest

from tests.engine.prompts import QUESTIONS, chat

NUM_TOKENS = 32
# 16 prompts, adapters A, B and the base in turn: every step of the batch mixes the three.
PROMPTS = [chat(q) for q in QUESTIONS] + [chat("Name two rivers in Europe.")]
ADAPTER_OF = ["A", "B", None] * 5 + ["A"]


@pytest.fixture(scope="session")
def prompt_ids(lora_llm):
    return [lora_llm.engine.encode(m) for m in PROMPTS]
