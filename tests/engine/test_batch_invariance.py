"""Batch invariance: a request's tokens do not depend on what else is in its batch.

32 prompts, each as a greedy request and as a seeded sampled request (n=2), all 64 requests in one
batch and then each request alone. Prefix caching is off in this engine so that "alone" really
recomputes every token by itself instead of reading KV the batched run left in the cache.
"""

from __future__ import annotations

import pytest

from batchgen.engine import SamplingParams
from tests.engine.helpers import run_requests
from tests.engine.prompts import INVARIANCE_PROMPTS

GREEDY = SamplingParams(temperature=0, max_tokens=16)
SAMPLED = SamplingParams(temperature=0.8, n=2, seed=1234, max_tokens=8)


@pytest.fixture(scope="module")
def uncached_llm(llm):
    return llm.with_engine_settings(enable_prefix_caching=False)


def test_32_prompts_together_equal_each_alone(uncached_llm):
    engine = uncached_llm.engine
    assert len(INVARIANCE_PROMPTS) == 32
    requests = {}
    for i, prompt in enumerate(INVARIANCE_PROMPTS):
        requests[f"greedy-{i}"] = (prompt, GREEDY)
        requests[f"sampled-{i}"] = (prompt, SAMPLED)

    steps_before = engine.stats["num_steps"]
    together = run_requests(engine, requests)
    # One batch: every decode step ran all 96 sequences together (16 greedy tokens, 2 prefill steps at most).
    assert engine.stats["num_steps"] - steps_before <= GREEDY.max_tokens + 2

    def tokens(out):
        return [c.token_ids for c in out.outputs]

    for request_id, request in requests.items():
        alone = run_requests(engine, {request_id: request})[request_id]
        assert tokens(alone) == tokens(together[request_id]), request_id

    # The samples are real samples: the two of a request differ somewhere, and differ from greedy.
    sampled = [tokens(together[f"sampled-{i}"]) for i in range(32)]
    assert sum(a != b for a, b in sampled) > 16
    assert sum(a != tokens(together[f"greedy-{i}"])[0][:8] for i, (a, _) in enumerate(sampled)) > 16
