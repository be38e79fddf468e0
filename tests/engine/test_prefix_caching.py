"""Automatic prefix caching on the bundled model: hits per request, same outputs on and off, evictions.

One model is loaded for the module; each run gets fresh KV bookkeeping (a new pool, an empty hash
table, a new scheduler) around it, built exactly as LLMEngine builds them, so runs do not see each
other's cache and the tests pay for one model load.
"""

from __future__ import annotations

import pytest

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.kv_cache_manager import KVCacheManager
from batchgen.engine.scheduler import Scheduler
from tests.engine.prefix_prompts import (
    NUM_SHARED_TOKENS,
    OTHER_SYSTEM,
    chat,
    shared_prefix_blocks_tokens,
    user_message,
)

MODEL = "smollm2-135m-instruct"
NUM_KV_BLOCKS = 256


@pytest.fixture(scope="module")
def engine():
    llm = LLM(MODEL, dtype="float32", device="cpu", max_model_len=512, num_kv_blocks=NUM_KV_BLOCKS)
    return llm.engine


def generate(engine, prompts, params: SamplingParams, *, enable_prefix_caching: bool = True,
             num_blocks: int = NUM_KV_BLOCKS, max_num_seqs: int = 64, max_num_batched_tokens: int = 384):
    """Run `prompts` to completion on fresh KV bookkeeping; request ids (hence sample seeds) are stable."""
    assert num_blocks <= engine.num_kv_blocks  # the runner's KV tensors hold that many blocks
    config = engine.config.replace(enable_prefix_caching=enable_prefix_caching, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens)
    engine.config = config
    engine.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
    engine.scheduler = Scheduler(config, engine.kv)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"req-{i}", prompt, params)
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out
    pool = engine.kv.pool
    assert pool.num_free_blocks == pool.num_blocks and not any(pool.ref_counts), "leaked KV blocks"
    return [outputs[f"req-{i}"] for i in range(len(prompts))]


def token_ids(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in out.outputs] for out in outputs]


def test_shared_system_prompt_is_computed_once(engine):
    prompts = [chat(user_message(i)) for i in range(128)]
    outputs = generate(engine, prompts, SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=4))
    expected = shared_prefix_blocks_tokens([out.prompt_token_ids for out in outputs])
    assert expected == NUM_SHARED_TOKENS >= 300
    assert outputs[0].num_cached_tokens == 0
    # Every later request hits every shared full block, and nothing more: the prompts differ after
    # the shared prefix, within its next (partial) block.
    assert [out.num_cached_tokens for out in outputs[1:]] == [expected] * (len(prompts) - 1)
    # Request 1 was admitted in the same step as request 0, whose blocks it shares before they are
    # written: the step's KV writes precede every read (see KVCacheManager.allocate_slots).
    assert outputs[1].metrics.first_scheduled_time == outputs[0].metrics.first_scheduled_time
    stats = engine.stats
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
def sampled_without_cache(engine):
    return token_ids(generate(engine, MIXED_PROMPTS, SAMPLED, enable_prefix_caching=False))


def test_sampled_outputs_same_with_caching_off(engine, sampled_without_cache):
    outputs = generate(engine, MIXED_PROMPTS, SAMPLED)
    assert outputs[2].num_cached_tokens == NUM_SHARED_TOKENS
    assert token_ids(outputs) == sampled_without_cache


def test_evicted_prefix_blocks_keep_outputs(engine, sampled_without_cache):
    # 23 blocks: one request's two samples (20 shared + 1 own block each) fit, but not their
    # decodes into a 22nd block each, so one preempts the other; the other system prompt's request
    # then evicts the tail of the first one's freed prefix, which request 2 partly revives.
    outputs = generate(engine, MIXED_PROMPTS, SAMPLED, num_blocks=23, max_num_seqs=2)
    stats = engine.stats
    assert stats["num_evictions"] > 0 and stats["num_preemptions"] > 0
    assert 0 < outputs[2].num_cached_tokens < NUM_SHARED_TOKENS
    assert token_ids(outputs) == sampled_without_cache


def test_greedy_outputs_same_with_caching_off(engine):
    first, other = engine.encode(chat(user_message(0))), engine.encode(chat(user_message(2)))
    # The middle prompt is the first one's shared blocks plus one token: admitted in the same step,
    # its single new token runs as a one-token query over 320 cached tokens written in that step.
    prompts = [first, first[:NUM_SHARED_TOKENS + 1], other]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    cached = generate(engine, prompts, params)
    assert [out.num_cached_tokens for out in cached] == [0, NUM_SHARED_TOKENS, NUM_SHARED_TOKENS]
    assert len({out.metrics.first_scheduled_time for out in cached}) == 1
    assert token_ids(cached) == token_ids(generate(engine, prompts, params, enable_prefix_caching=False))
