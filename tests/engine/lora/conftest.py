"""LoRA fixtures: one engine with enable_lora over the bundled model in HF form, the test prompts and
the adapter of each (A, B and the base mixed)."""

from __future__ import annotations

import pytest

from tests.conftest import TEST_ENGINE_KWARGS
from tests.engine.prompts import QUESTIONS, chat

NUM_TOKENS = 32
# 16 prompts, adapters A, B and the base in turn: every step of the batch mixes the three.
PROMPTS = [chat(q) for q in QUESTIONS] + [chat("Name two rivers in Europe.")]
ADAPTER_OF = ["A", "B", None] * 5 + ["A"]


@pytest.fixture(scope="session")
def lora_requests(lora_adapters):
    from batchgen.engine import LoRARequest

    _, folders = lora_adapters
    return {name: LoRARequest(name, i + 1, str(folder)) for i, (name, folder) in enumerate(sorted(folders.items()))}


@pytest.fixture(scope="session")
def lora_llm(smollm_hf_folder):
    from batchgen.engine import LLM

    return LLM(str(smollm_hf_folder), enable_lora=True, max_loras=4, max_lora_rank=16, **TEST_ENGINE_KWARGS)


@pytest.fixture(scope="session")
def prompt_ids(lora_llm):
    return [lora_llm.engine.encode(m) for m in PROMPTS]
