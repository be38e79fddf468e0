"""Prefix caching without a model: every step, each sequence must read exactly its own prefix's KV.

A fake runner writes, for each scheduled token, the token prefix it stands for into its cache slot
(all writes of a step before any read, as the attention backends do) and then checks every slot a
sequence attends to. Random workloads over a tiny pool exercise shared prefixes, n samples,
same-step sharing, revival of freed blocks, LRU eviction and preemption together.
"""

from __future__ import annotations

import random

from batchgen.engine.config import EngineConfig
from batchgen.engine.core.scheduler import Scheduler
from batchgen.engine.core.sequence import Sequence
from batchgen.engine.kv.kv_cache_manager import KVCacheManager
from batchgen.engine.sampling.sampling_params import SamplingParams

BLOCK_SIZE = 4


def _check_pool(kv: KVCacheManager, running: list[Sequence]) -> None:
    holders: dict[int, int] = {}
    for seq in running:
        assert len(set(seq.block_ids)) == len(seq.block_ids), "a block twice in one block table"
        for block_id in seq.block_ids:
            holders[block_id] = holders.get(block_id, 0) + 1
    pool = kv.pool
    for block_id in range(pool.num_blocks):
        assert pool.ref_counts[block_id] == holders.get(block_id, 0)
        assert (block_id in pool.free_queue) == (block_id not in holders)
    for key, block_id in pool.cached.items():
        assert pool.block_keys[block_id] == key


def _simulate(seed: int, num_blocks: int, enable_caching: bool) -> tuple[int, int, int] | None:
    """Run one random workload to the end; None when a request can never fit this pool."""
    rng = random.Random(seed)
    config = EngineConfig(model="unused", block_size=BLOCK_SIZE, max_num_seqs=6, max_num_batched_tokens=24)
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching)
    scheduler = Scheduler(config, kv)
    prefixes = [[rng.randrange(5) for _ in range(rng.randrange(1, 20))] for _ in range(3)]
    for request in range(rng.randrange(1, 12)):
        prompt = rng.choice(prefixes) + [rng.randrange(5) for _ in range(rng.randrange(0, 6))]
        if -(-(len(prompt) + 10) // BLOCK_SIZE) > num_blocks:
            return None  # could never run alone; the engine refuses such requests up front
        params = SamplingParams(max_tokens=rng.randrange(1, 10))
        for index in range(rng.choice([1, 2, 3])):
            scheduler.add(Sequence(str(request), index, prompt, params, 0.0, 10**6))
    slots: dict[int, tuple[int, ...]] = {}  # slot -> the token prefix whose KV it holds
    for _ in range(10_000):
        if not scheduler.has_unfinished():
            break
        out = scheduler.schedule()
        assert not out.is_empty
        _check_pool(kv, scheduler.running)
        for s in out.scheduled:
            seq, start = s.seq, s.seq.num_computed_tokens
            for pos in range(start, start + s.num_new_tokens):
                slot = seq.block_ids[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
                slots[slot] = tuple(seq.token_ids[:pos + 1])
        for s in out.scheduled:
            seq = s.seq
            for pos in range(seq.num_computed_tokens + s.num_new_tokens):
                slot = seq.block_ids[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
                assert slots.get(slot) == tuple(seq.token_ids[:pos + 1]), f"seed {seed}: stale KV at {pos}"
        sampled = [s for s in out.scheduled if s.is_sampling]  # read before the positions advance
        for s in out.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
        for s in sampled:
            s.seq.append_token(rng.randrange(5), None)
            if s.seq.num_output_tokens >= s.seq.params.max_tokens:
                scheduler.finish(s.seq)
    assert not scheduler.has_unfinished()
    assert kv.pool.num_free_blocks == num_blocks and not any(kv.pool.ref_counts), "leaked blocks"
    return kv.pool.num_evictions, scheduler.stats.num_preemptions, scheduler.stats.num_cached_tokens


def test_every_step_reads_its_own_prefix_kv():
    totals = [0, 0, 0]
    for seed in range(150):
        for num_blocks, enable_caching in ((9, True), (14, True), (40, True), (9, False)):
            result = _simulate(seed, num_blocks, enable_caching)
            if result is not None:
                totals = [t + r for t, r in zip(totals, result)]
    num_evictions, num_preemptions, num_cached_tokens = totals
    # The workloads must actually reach the paths this test is about.
    assert num_evictions > 0 and num_preemptions > 0 and num_cached_tokens > 0
