"""BlockPool and KVCacheManager invariants on the CPU, no model: ref counts, LRU order, prefix hits."""

from __future__ import annotations

import pytest

from batchgen.engine.core.sequence import Sequence
from batchgen.engine.kv.block_pool import NO_PARENT, BlockPool, hash_block
from batchgen.engine.kv.kv_cache_manager import KVCacheManager
from batchgen.engine.sampling.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_seq(token_ids: list[int], request_id: str = "r") -> Sequence:
    return Sequence(request_id, 0, list(token_ids), SamplingParams(temperature=0), 0.0, 10_000)


def assert_pool_consistent(pool: BlockPool) -> None:
    """Every block is either referenced or in the free queue, never both; the hash table is two-way."""
    for block_id in range(pool.num_blocks):
        is_free = block_id in pool.free_queue
        assert is_free == (pool.ref_counts[block_id] == 0), f"block {block_id}"
        assert pool.ref_counts[block_id] >= 0
    for key, block_id in pool.cached.items():
        assert pool.block_keys[block_id] == key
    assert sum(key is not None for key in pool.block_keys) == len(pool.cached)


# ---- BlockPool -------------------------------------------------------------------------------------

def test_allocate_takes_references_and_free_returns_them():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert len(set(blocks)) == 3
    assert [pool.ref_counts[b] for b in blocks] == [1, 1, 1]
    assert pool.num_free_blocks == 1 and pool.num_used_blocks == 3
    pool.free(blocks)
    assert pool.num_free_blocks == 4
    assert_pool_consistent(pool)


def test_a_shared_block_is_free_only_after_its_last_reference():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.cache_block(block, hash_block(NO_PARENT, (1, 2)))
    pool.touch(block)  # a second sequence shares it
    pool.free([block])
    assert pool.ref_counts[block] == 1 and block not in pool.free_queue
    pool.free([block])
    assert pool.ref_counts[block] == 0 and block in pool.free_queue
    assert_pool_consistent(pool)


def test_double_free_is_caught():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(AssertionError):
        pool.free([block])


def test_free_queue_is_lru_and_reuse_evicts_the_oldest_cached_block():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    keys = {blk: hash_block(NO_PARENT, (blk,)) for blk in (a, b, c)}
    for blk, key in keys.items():
        pool.cache_block(blk, key)
    pool.free([b])
    pool.free([c])
    pool.free([a])  # free order: b, c, a
    (first,) = pool.allocate(1)
    assert first == b  # least recently freed goes first
    assert pool.lookup(keys[b]) is None and pool.num_evictions == 1
    assert pool.lookup(keys[c]) == c and pool.lookup(keys[a]) == a  # still revivable
    pool.touch(a)  # reviving takes it off the free queue
    (second,) = pool.allocate(1)
    assert second == c
    assert pool.num_free_blocks == 0
    assert_pool_consistent(pool)


def test_caching_an_already_cached_key_keeps_the_first_block():
    pool = BlockPool(2)
    first, second = pool.allocate(2)
    key = hash_block(NO_PARENT, (7, 7))
    assert pool.cache_block(first, key) == first
    assert pool.cache_block(second, key) == first
    assert pool.block_keys[second] is None  # the duplicate stays private and is freed without a key
    pool.free([second, first])
    assert_pool_consistent(pool)


def test_disabled_caching_never_hits():
    pool = BlockPool(2, enable_caching=False)
    (block,) = pool.allocate(1)
    key = hash_block(NO_PARENT, (1,))
    pool.cache_block(block, key)
    assert pool.lookup(key) is None


# ---- KVCacheManager ----------------------------------------------------------------------------------

def test_prefix_hits_follow_the_hash_chain():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    first = make_seq(list(range(10)), "a")  # blocks [0-3], [4-7] full, [8, 9] partial
    assert kv.get_computed_blocks(first) == []
    assert kv.allocate_slots(first, first.num_tokens, [])
    assert len(first.block_ids) == 3

    same_prefix = make_seq(list(range(8)) + [99, 98, 97], "b")
    hits = kv.get_computed_blocks(same_prefix)
    assert hits == first.block_ids[:2]

    # Block 1 holds the same tokens as `first`'s block 1 but follows a different block 0: its chained
    # key differs, so the cache has no entry for it even looked up directly.
    other_start = make_seq([50, 1, 2, 3] + list(range(4, 8)) + [0], "c")
    assert kv.get_computed_blocks(other_start) == []
    other_keys = kv._block_keys(other_start, 2)
    assert other_keys[1][1] == tuple(range(4, 8))
    assert kv.pool.lookup(other_keys[1]) is None
    assert kv.pool.lookup(kv._block_keys(first, 2)[1]) == first.block_ids[1]


def test_a_fully_cached_prompt_still_computes_its_last_token():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    first = make_seq(list(range(8)), "a")
    assert kv.allocate_slots(first, 8, [])
    again = make_seq(list(range(8)), "b")
    hits = kv.get_computed_blocks(again)
    assert hits == first.block_ids[:1]  # the last block is recomputed to produce logits


def test_shared_blocks_are_ref_counted_and_nothing_leaks():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    pool = kv.pool
    a = make_seq(list(range(9)), "a")
    assert kv.allocate_slots(a, 9, [])
    b = make_seq(list(range(8)) + [42], "b")
    hits = kv.get_computed_blocks(b)
    assert kv.allocate_slots(b, 1, hits)
    shared = a.block_ids[:2]
    assert b.block_ids[:2] == shared and b.block_ids[2] != a.block_ids[2]
    assert [pool.ref_counts[x] for x in shared] == [2, 2]
    kv.free(a)
    assert [pool.ref_counts[x] for x in shared] == [1, 1]
    kv.free(b)
    assert pool.num_free_blocks == pool.num_blocks
    assert all(count == 0 for count in pool.ref_counts)
    assert_pool_consistent(pool)


def test_freed_blocks_are_revived_by_a_later_request():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    a = make_seq(list(range(9)), "a")
    assert kv.allocate_slots(a, 9, [])
    prefix_blocks = a.block_ids[:2]
    kv.free(a)
    assert kv.pool.num_free_blocks == 4
    b = make_seq(list(range(8)) + [5, 6], "b")
    hits = kv.get_computed_blocks(b)
    assert hits == prefix_blocks
    assert kv.allocate_slots(b, 2, hits)
    assert b.block_ids[:2] == prefix_blocks
    assert kv.pool.num_free_blocks == 1
    assert_pool_consistent(kv.pool)


def test_allocate_slots_refuses_without_side_effects_when_blocks_run_out():
    kv = KVCacheManager(num_blocks=3, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    a = make_seq(list(range(8)), "a")
    assert kv.allocate_slots(a, 8, [])
    b = make_seq(list(range(100, 108)), "b")
    assert not kv.allocate_slots(b, 8, [])
    assert b.block_ids == [] and kv.pool.num_free_blocks == 1
    # Counting revived blocks: the hit on a freed block costs a free block too.
    kv.free(a)
    c = make_seq(list(range(8)) + list(range(200, 212)), "c")  # 20 tokens = 5 blocks > 3
    hits = kv.get_computed_blocks(c)
    assert len(hits) == 2
    assert not kv.allocate_slots(c, c.num_tokens - 8, hits)
    assert c.block_ids == [] and kv.pool.num_free_blocks == 3
    assert_pool_consistent(kv.pool)


def test_decode_grows_the_block_table_one_block_at_a_time():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    seq = make_seq(list(range(4)), "a")
    assert kv.allocate_slots(seq, 4, [])
    seq.num_computed_tokens = 4
    assert len(seq.block_ids) == 1
    for step in range(6):
        seq.token_ids.append(1000 + step)
        assert kv.allocate_slots(seq, 1)
        seq.num_computed_tokens += 1
        assert len(seq.block_ids) == -(-seq.num_tokens // BLOCK_SIZE)
    # The block filled by generated tokens is in the cache too (chained after the prompt block).
    other = make_seq(seq.token_ids[:8] + [7], "b")
    assert kv.get_computed_blocks(other) == seq.block_ids[:2]
