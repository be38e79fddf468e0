"""Batch invariance: a request's tokens do not depend on what else is in its batch.

32 prompts, each as a greedy request and as a seeded sampled request (n=2): all 64 requests in one
batch, then requests alone. Prefix caching is off in these engines so that "alone" really recomputes
every token by itself instead of reading KV the batched run left in the cache.

Two models share the work:
- a tiny random-weight Llama with the bundled model's head_dim and KV-head group: every one of the 64
  requests alone (the batching, paged KV, attention kernels and seeded sampling, request by request);
- the bundled SmolLM2, its real shapes and logits: the same 64-request batch, and alone the prompts
  at the KV-block boundaries (15, 32, 33 tokens) and the longest one (119 tokens).
Random weights make near-ties common, so the tiny model is the stricter test of bitwise invariance.
"""

from __future__ import annotations

import pytest

from batchgen.engine import LLM, LLMEngine, RequestOutput, SamplingParams
from tests.conftest import TEST_ENGINE_KWARGS
from tests.engine.helpers import run_requests
from tests.engine.prompts import BOUNDARY_CHATS, INVARIANCE_PROMPTS, LONG_INDEX
from tests.pipeline.tiny_model import write_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=16)
SAMPLED = SamplingParams(temperature=0.8, n=2, seed=1234, max_tokens=8)
ALL_PROMPTS = range(len(INVARIANCE_PROMPTS))
# Prompt indices run alone on the real model: 15 tokens (under one block), 32 (two full blocks),
# 33 (one token into the third block), and the long prompt.
REAL_MODEL_ALONE = [list(BOUNDARY_CHATS).index(n) for n in (15, 32, 33)] + [LONG_INDEX]
# SmolLM2-135M's attention shape (head_dim 64, 3 query heads per KV head) at a tenth of its width.
TINY_SHAPE = dict(hidden=192, intermediate=384, num_layers=2, num_heads=3, num_kv_heads=1)


@pytest.fixture(scope="module")
def uncached_llm(llm):
    return llm.with_engine_settings(enable_prefix_caching=False)


@pytest.fixture(scope="module")
def tiny_uncached_llm(llm, tmp_path_factory):
    # The session engine's tokenizer is already loaded: the tiny model reuses it (and its chat template).
    folder = write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", llm.engine.tokenizer.hf, **TINY_SHAPE)
    return LLM(str(folder), **{**TEST_ENGINE_KWARGS, "max_model_len": 256, "enable_prefix_caching": False})


def tokens(out: RequestOutput) -> list[list[int]]:
    return [c.token_ids for c in out.outputs]


def run_together_then_alone(engine: LLMEngine, alone: list[int]) -> dict[str, RequestOutput]:
    """All 64 requests in one batch, then the greedy and the sampled request of each `alone` prompt by itself."""
    assert len(INVARIANCE_PROMPTS) == 32
    requests = {}
    for i, prompt in enumerate(INVARIANCE_PROMPTS):
        requests[f"greedy-{i}"] = (prompt, GREEDY)
        requests[f"sampled-{i}"] = (prompt, SAMPLED)

    steps_before = engine.stats["num_steps"]
    together = run_requests(engine, requests)
    # One batch: every decode step ran all 96 sequences together (16 greedy tokens, 2 prefill steps at most).
    assert engine.stats["num_steps"] - steps_before <= GREEDY.max_tokens + 2

    for i in alone:
        for request_id in (f"greedy-{i}", f"sampled-{i}"):
            by_itself = run_requests(engine, {request_id: requests[request_id]})[request_id]
            assert tokens(by_itself) == tokens(together[request_id]), request_id
    return together


def num_real_samples(together: dict[str, RequestOutput]) -> tuple[int, int]:
    """(prompts whose two samples differ, prompts whose first sample differs from greedy's first 8 tokens)."""
    sampled = [tokens(together[f"sampled-{i}"]) for i in ALL_PROMPTS]
    greedy = [tokens(together[f"greedy-{i}"])[0][:SAMPLED.max_tokens] for i in ALL_PROMPTS]
    return sum(a != b for a, b in sampled), sum(a != g for (a, _), g in zip(sampled, greedy))


def test_32_prompts_together_equal_each_alone(tiny_uncached_llm):
    together = run_together_then_alone(tiny_uncached_llm.engine, alone=list(ALL_PROMPTS))
    # Near-uniform logits over a 49k vocabulary: every pair of samples differs, and differs from greedy.
    assert num_real_samples(together) == (32, 32)


@pytest.mark.slow
def test_real_model_together_equal_alone_at_block_boundaries(uncached_llm):
    together = run_together_then_alone(uncached_llm.engine, alone=REAL_MODEL_ALONE)
    # The samples are real samples: on most prompts the two differ, and differ from greedy. (A trained
    # model's short answers can coincide at temperature 0.8; half the prompts is the floor.)
    num_differing_pairs, num_differing_from_greedy = num_real_samples(together)
    assert num_differing_pairs > 16 and num_differing_from_greedy > 16
