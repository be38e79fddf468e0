"""Automatic prefix caching on the bundled model: hits per request, same outputs on and off, evictions.

Each run gets its own engine over the session's loaded weights (`llm.with_engine_settings`): a new
pool, an empty hash table, a new scheduler and counters, so runs do not see each other's cache and
the tests pay for no model load.
"""

from __future__ import annotations

import pytest

from batchgen.engine import SamplingParams
from tests.engine.prefix_prompts import (
    NUM_SHARED_TOKENS,
    OTHER_SYSTEM,
    chat,
    shared_prefix_blocks_tokens,
    user_message,
)

NUM_KV_BLOCKS = 256
MAX_MODEL_LEN = 512


def generate(llm, prompts, params: SamplingParams, *, enable_prefix_caching: bool = True,
             num_blocks: int = NUM_KV_BLOCKS, max_num_seqs: int = 64,
             max_num_batched_tokens: int = 384) -> tuple[list, dict]:
    """Run `prompts` to completion on a fresh engine; request ids (hence sample seeds) are stable.
    Returns the outputs in prompt order and the engine's stats."""
    engine = llm.with_engine_settings(
        enable_prefix_caching=enable_prefix_caching, num_kv_blocks=num_blocks, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=min(MAX_MODEL_LEN, num_blocks * llm.engine.config.block_size)).engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"req-{i}", prompt, params)
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out
    stats = engine.stats
    assert stats["num_free_blocks"] == stats["num_blocks"] == num_blocks, "leaked KV blocks"
    return [outputs[f"req-{i}"] for i in range(len(prompts))], stats


def token_ids(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in out.outputs] for out in outputs]


@pytest.mark.slow
def test_shared_system_prompt_is_computed_once(llm):
    prompts = [chat(user_message(i)) for i in range(128)]
    outputs, stats = generate(llm, prompts, SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=4))
    expected = shared_prefix_blocks_tokens([out.prompt_token_ids for out in outputs])
    assert expected == NUM_SHARED_TOKENS >= 300
    assert outputs[0].num_cached_tokens == 0
    # Every later request hits every shared full block, and nothing more: the prompts differ after
    # the shared prefix, within its next (partial) block.
    assert [out.num_cached_tokens for out in outputs[1:]] == [expected] * (len(prompts) - 1)
    # Request 1 was admitted in the same step as request 0, whose blocks it shares before they are
    # written: the step's KV writes precede every read (see KVCacheManager.allocate_slots).
    assert outputs[1].metrics.first_scheduled_time == outputs[0].metrics.first_scheduled_time
    # Both samples of every request (255 sequences after the first) skip the shared blocks.
    assert stats["num_cached_tokens"] == expected * (2 * len(prompts) - 1)
    num_prompt_tokens = 2 * sum(len(out.prompt_token_ids) for out in outputs)
    assert stats["num_prefill_tokens"] == num_prompt_tokens - stats["num_cached_tokens"]
    assert stats["prefix_cache_hit_rate"] > 0.9
    assert all(len(c.token_ids) == 4 for out in outputs for c in out.outputs)


# Requests of the two system prompts alternate, so a pool that holds one request evicts the other's.
MIXED_PROMPTS = [chat(user_message(0)), chat(user_message(1), OTHER_SYSTEM), chat(user_message(2))]
SAMPLED = SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=8)


@pytest.fixture(scope="module")
def sampled_without_cache(llm):
    return token_ids(generate(llm, MIXED_PROMPTS, SAMPLED, enable_prefix_caching=False)[0])


def test_sampled_outputs_same_with_caching_off(llm, sampled_without_cache):
    outputs, _ = generate(llm, MIXED_PROMPTS, SAMPLED)
    assert outputs[2].num_cached_tokens == NUM_SHARED_TOKENS
    assert token_ids(outputs) == sampled_without_cache


def test_evicted_prefix_blocks_keep_outputs(llm, sampled_without_cache):
    # 23 blocks: one request's two samples (20 shared + 1 own block each) fit, but not their
    # decodes into a 22nd block each, so one preempts the other; the other system prompt's request
    # then evicts the tail of the first one's freed prefix, which request 2 partly revives.
    outputs, stats = generate(llm, MIXED_PROMPTS, SAMPLED, num_blocks=23, max_num_seqs=2)
    assert stats["num_evictions"] > 0 and stats["num_preemptions"] > 0
    assert 0 < outputs[2].num_cached_tokens < NUM_SHARED_TOKENS
    assert token_ids(outputs) == sampled_without_cache


def test_greedy_outputs_same_with_caching_off(llm):
    first, other = llm.engine.encode(chat(user_message(0))), llm.engine.encode(chat(user_message(2)))
    # The middle prompt is the first one's shared blocks plus one token: admitted in the same step,
    # its single new token runs as a one-token query over 320 cached tokens written in that step.
    prompts = [first, first[:NUM_SHARED_TOKENS + 1], other]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    cached, _ = generate(llm, prompts, params)
    assert [out.num_cached_tokens for out in cached] == [0, NUM_SHARED_TOKENS, NUM_SHARED_TOKENS]
    assert len({out.metrics.first_scheduled_time for out in cached}) == 1
    assert token_ids(cached) == token_ids(generate(llm, prompts, params, enable_prefix_caching=False)[0])
