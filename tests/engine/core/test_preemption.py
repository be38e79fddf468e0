"""Preemption under a pool too small for the batch: same outputs, nothing leaked.

20 blocks of 16 tokens hold 320 tokens; the eight greedy requests below grow to about 80 tokens each
(the long one to 167) and the two sampled requests add four more sequences, so the scheduler must
preempt running sequences and recompute them later, reviving their cached blocks where it can.
"""

from __future__ import annotations

import pytest

from batchgen.engine import SamplingParams
from tests.engine.helpers import GREEDY, run_requests
from tests.engine.prompts import CHAT_PROMPTS, LONG_INDEX

NUM_BLOCKS = 20
SAMPLED = SamplingParams(temperature=0.8, n=2, seed=7, max_tokens=24)
GREEDY_INDICES = list(range(7)) + [LONG_INDEX]


def test_tiny_pool_preempts_and_still_gives_the_same_outputs(llm, llm_chat_greedy):
    # A 48-token step budget as well: sequences are also preempted in the middle of a chunked prefill.
    small = llm.with_engine_settings(num_kv_blocks=NUM_BLOCKS, max_model_len=NUM_BLOCKS * 16,
                                     max_num_batched_tokens=48)
    engine = small.engine
    requests = {f"greedy-{i}": (CHAT_PROMPTS[i], GREEDY) for i in GREEDY_INDICES}
    sampled = {f"sampled-{i}": (CHAT_PROMPTS[i], SAMPLED) for i in (9, 10)}
    outputs = run_requests(engine, {**requests, **sampled})

    stats = engine.stats
    assert stats["num_preemptions"] > 0 and stats["num_partial_prefills"] > 0
    for i in GREEDY_INDICES:
        assert outputs[f"greedy-{i}"].outputs[0].token_ids == llm_chat_greedy[i], f"prompt {i}"
    # Seeded samples survive preemption too: same as on the roomy engine (same request ids).
    roomy = run_requests(llm.engine, sampled)
    for request_id in sampled:
        assert ([c.token_ids for c in outputs[request_id].outputs]
                == [c.token_ids for c in roomy[request_id].outputs]), request_id

    # Every block is back in the free queue with no reference left.
    pool = engine.kv_cache_manager.pool
    assert stats["num_free_blocks"] == stats["num_blocks"] == NUM_BLOCKS
    assert all(count == 0 for count in pool.ref_counts)
    assert not engine.has_unfinished() and engine.num_unfinished_requests == 0


def test_engines_sharing_weights_refuse_model_changes(llm):
    # with_engine_settings (used above) may change only KV/scheduling settings: a different dtype or
    # a longer context would need other weights or rotary tables than the ones it shares.
    with pytest.raises(ValueError, match="dtype"):
        llm.with_engine_settings(dtype="bfloat16")
    with pytest.raises(ValueError, match="max_model_len"):
        llm.with_engine_settings(max_model_len=llm.engine.max_model_len + 1)
