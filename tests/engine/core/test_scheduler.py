"""Scheduler invariants on the CPU without a model: a fake step loop stands in for the runner.

The loop does what LLMEngine.step does with the scheduler's output (advance num_computed_tokens,
append a token to each sampling sequence, finish after max_tokens), so every scheduling path
(chunked prefill, mixed steps, prefix hits, preemption and recompute) runs in milliseconds.
"""

from __future__ import annotations

import random

from batchgen.engine.config import EngineConfig
from batchgen.engine.core.scheduler import Scheduler
from batchgen.engine.core.sequence import Sequence, SequenceStatus
from batchgen.engine.kv.kv_cache_manager import KVCacheManager
from batchgen.engine.sampling.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_scheduler(num_blocks: int, max_num_batched_tokens: int = 64, max_num_seqs: int = 8,
                   enable_prefix_caching: bool = True) -> Scheduler:
    config = EngineConfig(model="unused", device="cpu", block_size=BLOCK_SIZE, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens,
                          enable_prefix_caching=enable_prefix_caching)
    return Scheduler(config, KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching))


def make_seq(request_id: str, prompt: list[int], max_tokens: int) -> Sequence:
    return Sequence(request_id, 0, prompt, SamplingParams(temperature=0, max_tokens=max_tokens), 0.0, 10_000)


def next_token(seq: Sequence) -> int:
    # Deterministic in the sequence's own history, as greedy decoding is: a recomputed sequence
    # must produce the same tokens as one that never was preempted.
    return (sum(seq.token_ids) * 31 + seq.num_tokens) % 1000


def check_invariants(sched: Scheduler) -> None:
    pool = sched.kv_cache_manager.pool
    assert len(sched.running) <= sched.config.max_num_seqs
    holders: dict[int, int] = {}
    for seq in sched.running:
        assert seq.status == SequenceStatus.RUNNING
        assert len(seq.block_ids) * BLOCK_SIZE >= seq.num_computed_tokens
        for block_id in seq.block_ids:
            holders[block_id] = holders.get(block_id, 0) + 1
    for seq in sched.waiting:
        assert seq.block_ids == [] and seq.num_computed_tokens == 0
    for block_id in range(pool.num_blocks):
        assert pool.ref_counts[block_id] == holders.get(block_id, 0), f"block {block_id}"
        assert (block_id in pool.free_queue) == (pool.ref_counts[block_id] == 0)


def run(sched: Scheduler, seqs: list[Sequence], *, arrivals: dict[int, list[Sequence]] | None = None,
        max_steps: int = 10_000) -> dict[str, list[int]]:
    """Drive `sched` until every sequence finished; returns output tokens per request id."""
    for seq in seqs:
        sched.add(seq)
    arrivals = arrivals or {}
    outputs: dict[str, list[int]] = {}
    for step in range(max_steps):
        for seq in arrivals.pop(step, []):
            sched.add(seq)
        if not sched.has_unfinished() and not arrivals:
            return outputs
        out = sched.schedule()
        assert out.num_tokens <= sched.config.max_num_batched_tokens
        assert len(out.scheduled) <= sched.config.max_num_seqs
        assert len({id(s.seq) for s in out.scheduled}) == len(out.scheduled)
        check_invariants(sched)
        sampling = [s.seq for s in out.scheduled if s.is_sampling]
        for s in out.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
        for seq in sampling:
            seq.token_ids.append(next_token(seq))
            if seq.num_output_tokens >= seq.params.max_tokens:
                outputs[seq.request_id] = seq.output_token_ids
                sched.finish(seq)
        check_invariants(sched)
    raise AssertionError("the scheduler did not finish")


def random_prompts(num: int, seed: int, shared_prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = shared_prefix or []
    return [prefix + [rng.randrange(1000) for _ in range(rng.randint(1, 30))] for _ in range(num)]


def expected_outputs(prompts: list[list[int]], max_tokens: int) -> dict[str, list[int]]:
    """What each sequence produces alone with all the room it needs."""
    result = {}
    for i, prompt in enumerate(prompts):
        seq = make_seq(str(i), list(prompt), max_tokens)
        while seq.num_output_tokens < max_tokens:
            seq.token_ids.append(next_token(seq))
        result[str(i)] = seq.output_token_ids
    return result


def test_token_budget_chunks_long_prompts_and_mixes_decodes():
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=16)
    prompts = [[1, 2, 3], list(range(100, 140))]  # the second needs three chunks of the budget
    seqs = [make_seq(str(i), p, 6) for i, p in enumerate(prompts)]
    assert run(sched, seqs) == expected_outputs(prompts, 6)
    stats = sched.stats
    assert stats.num_partial_prefills >= 2
    assert stats.num_mixed_steps >= 1
    assert stats.num_prefill_tokens == 43 and stats.num_decode_tokens == 2 * 5
    assert sched.kv_cache_manager.pool.num_free_blocks == 64


def test_max_num_seqs_caps_running_sequences():
    sched = make_scheduler(num_blocks=64, max_num_seqs=3)
    prompts = random_prompts(7, seed=1)
    seqs = [make_seq(str(i), p, 4) for i, p in enumerate(prompts)]
    for seq in seqs:
        sched.add(seq)
    out = sched.schedule()
    assert len(out.scheduled) == 3 and len(sched.waiting) == 4
    # The rest are admitted as the first ones finish; run() checks the cap at every step.
    sched = make_scheduler(num_blocks=64, max_num_seqs=3)
    seqs = [make_seq(str(i), p, 4) for i, p in enumerate(prompts)]
    assert run(sched, seqs) == expected_outputs(prompts, 4)


def test_preemption_recomputes_and_gives_the_same_outputs():
    # 12 blocks of 4 tokens; 6 sequences of up to 30 + 12 tokens cannot all be resident.
    sched = make_scheduler(num_blocks=12, max_num_batched_tokens=32)
    prompts = random_prompts(6, seed=2)
    seqs = [make_seq(str(i), p, 12) for i, p in enumerate(prompts)]
    assert run(sched, seqs) == expected_outputs(prompts, 12)
    assert sched.stats.num_preemptions > 0
    pool = sched.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(count == 0 for count in pool.ref_counts)


def test_preemption_takes_the_newest_running_sequence():
    sched = make_scheduler(num_blocks=6, max_num_batched_tokens=64)
    seqs = [make_seq(name, [base + i for i in range(8)], 20)  # 2 full blocks each
            for name, base in (("old", 0), ("mid", 100), ("new", 200))]
    for seq in seqs:
        sched.add(seq)
    out = sched.schedule()
    assert [s.seq.request_id for s in out.scheduled] == ["old", "mid", "new"]
    for s in out.scheduled:
        s.seq.num_computed_tokens += s.num_new_tokens
        s.seq.token_ids.append(0)
    # Each now has 9 tokens; computing the 9th needs a third block each, and none is free.
    out = sched.schedule()
    assert [s.seq.request_id for s in out.scheduled] == ["old", "mid"]
    assert out.num_preempted == 1
    new = seqs[2]
    assert new.status == SequenceStatus.WAITING and new.block_ids == [] and new.num_computed_tokens == 0
    assert list(sched.waiting) == [new]
    check_invariants(sched)


def test_shared_prefix_hits_and_late_arrivals_leak_nothing():
    prefix = list(range(500, 520))  # five full blocks shared by everyone
    prompts = random_prompts(10, seed=3, shared_prefix=prefix)
    seqs = [make_seq(str(i), p, 5) for i, p in enumerate(prompts)]
    sched = make_scheduler(num_blocks=40, max_num_batched_tokens=24, max_num_seqs=4)
    # Half arrive while the first half is already decoding (continuous batching).
    outputs = run(sched, seqs[:5], arrivals={3: seqs[5:8], 7: seqs[8:]})
    assert outputs == expected_outputs(prompts, 5)
    assert sched.stats.num_cached_tokens >= 9 * len(prefix)  # all but the first reuse the prefix
    pool = sched.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks and all(c == 0 for c in pool.ref_counts)


def test_random_workloads_under_pressure():
    for seed in range(8):
        rng = random.Random(seed)
        num_blocks = rng.randint(14, 24)  # the longest sequence needs 13
        prompts = random_prompts(rng.randint(3, 9), seed=100 + seed,
                                 shared_prefix=[7] * rng.choice([0, 4, 9]))
        max_tokens = rng.randint(1, 10)
        sched = make_scheduler(num_blocks=num_blocks, max_num_batched_tokens=rng.choice([8, 17, 64]),
                               max_num_seqs=rng.randint(1, 6), enable_prefix_caching=rng.random() < 0.7)
        seqs = [make_seq(str(i), p, max_tokens) for i, p in enumerate(prompts)]
        assert run(sched, seqs) == expected_outputs(prompts, max_tokens), f"seed {seed}"
        pool = sched.kv_cache_manager.pool
        assert pool.num_free_blocks == num_blocks, f"seed {seed}"
