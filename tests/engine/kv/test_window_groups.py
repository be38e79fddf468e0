"""The sliding-window layers' block group (kv/window_groups.py) in the KV cache manager alone: which blocks a
sequence gives back as it advances, prefix hits that need the local blocks inside the window at the hit,
forks' copies on write in both pools, the split of a budget, and where the group is not made.

Model-level proof (tokens equal HF's through all of it, Gemma 2 and 3) is in tests/engine/models/test_gemma.py.
"""

from __future__ import annotations

import pytest

from batchgen.engine.core.sequence import Sequence
from batchgen.engine.kv.kv_cache_manager import KVCacheManager
from batchgen.engine.kv.window_groups import (
    WindowedKV,
    max_local_blocks,
    window_start_block,
    windowed_kv_split,
)
from batchgen.engine.sampling.sampling_params import SamplingParams

BS, WINDOW = 4, 6


def manager(num_blocks: int = 64, num_local: int = 32) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, True, WindowedKV(frozenset({0}), WINDOW, num_blocks, num_local))


def sequence(tokens: list[int], name: str = "s") -> Sequence:
    return Sequence(name, 0, tokens, SamplingParams(max_tokens=64), 0.0, 256)


def advance(kv: KVCacheManager, seq: Sequence, num_tokens: int) -> None:
    assert kv.allocate_slots(seq, num_tokens)
    seq.num_computed_tokens += num_tokens


def held(seq: Sequence) -> list[int]:
    return seq.local_block_ids[seq.num_local_freed:]


def test_window_arithmetic():
    # a query at p sees positions > p - W: at p = 9 with W = 6, positions 4.. (block 1 on)
    assert [window_start_block(p, WINDOW, BS) for p in (0, 5, 6, 8, 9, 13)] == [0, 0, 0, 0, 1, 2]
    assert max_local_blocks(WINDOW, BS) == 3 and max_local_blocks(1024, 16) == 65 and max_local_blocks(16, 16) == 2


def test_a_decoding_sequence_gives_back_the_local_blocks_before_its_window():
    kv = manager()
    seq = sequence(list(range(100, 140)))
    advance(kv, seq, 12)  # a 12-token prefill: blocks 0..2 in both tables
    assert len(seq.block_ids) == len(seq.local_block_ids) == 3 and seq.num_local_freed == 0
    most = 0
    for _ in range(20):  # decodes at positions 12..31
        advance(kv, seq, 1)
        start = window_start_block(seq.num_computed_tokens - 1, WINDOW, BS)  # the last query's window
        assert seq.num_local_freed == start and seq.local_block_ids[:start] == [0] * start
        most = max(most, len(held(seq)))
    assert most == max_local_blocks(WINDOW, BS) and len(seq.block_ids) == 8  # global: every block kept
    assert kv.local_pool.num_used_blocks == len(held(seq))
    kv.free(seq)
    assert kv.local_pool.num_used_blocks == kv.pool.num_used_blocks == 0


def test_a_prefix_hit_needs_the_local_blocks_inside_the_window_at_the_hit():
    kv = manager()
    prompt = list(range(100, 124))  # 6 full blocks
    first = sequence(prompt + [1], "first")
    advance(kv, first, 25)
    kv.free(first)  # every block freed keeping its key (local blocks 0..5 freed earlier or now)
    second = sequence(prompt + [2], "second")
    hits = kv.get_computed_blocks(second)
    assert len(hits) == 6  # the hit at 24 tokens reads local blocks 4, 5 (positions 19..23): cached
    # Evict local block 5 (held by nobody, keyed): a 5-block hit's first query (position 20) reads positions
    # 15..19, local blocks 3 and 4, still cached.
    block5 = kv.local_pool.lookup(second.block_hashes[5])
    del kv.local_pool.cached[kv.local_pool.block_keys[block5]]
    kv.local_pool.block_keys[block5] = None
    assert len(kv.get_computed_blocks(second)) == 5
    # Evict local block 3 too: a 5-block hit reads it, a 4-block hit (positions 11..15: blocks 2, 3) too;
    # a 3-block hit reads blocks 1, 2: that one.
    block3 = kv.local_pool.lookup(second.block_hashes[3])
    del kv.local_pool.cached[kv.local_pool.block_keys[block3]]
    kv.local_pool.block_keys[block3] = None
    hits = kv.get_computed_blocks(second)
    assert len(hits) == 3
    assert kv.allocate_slots(second, second.num_tokens - 12, hits)
    # its local table: the hit's blocks inside the window at 12 (positions 7..11: blocks 1, 2) revived, block 0
    # never held, then new blocks for positions 12..24
    assert second.num_local_freed == 1 and len(second.local_block_ids) == len(second.block_ids) == 7
    assert second.local_block_ids[1:3] == [kv.local_pool.lookup(k) for k in second.block_hashes[1:3]]


def test_a_forks_first_write_copies_its_block_in_both_pools():
    kv = manager(num_blocks=16, num_local=8)
    parent = sequence(list(range(100, 110)), "parent")
    advance(kv, parent, 10)  # mid-block: block 2 holds positions 8, 9
    child = sequence(list(range(100, 110)), "child")
    kv.fork(parent, child)
    parent.token_ids.append(5)
    child.token_ids.append(6)
    advance(kv, child, 1)
    copies = kv.take_copies()
    assert copies == [(parent.block_ids[2], child.block_ids[2]),  # global ids, then local ids from 16 on
                      (16 + parent.local_block_ids[2], 16 + child.local_block_ids[2])]
    assert child.local_block_ids[2] != parent.local_block_ids[2] and child.block_ids[2] != parent.block_ids[2]
    kv.free(parent)
    kv.free(child)
    assert kv.local_pool.num_used_blocks == kv.pool.num_used_blocks == 0


def test_no_room_in_the_local_pool_changes_nothing():
    kv = manager(num_blocks=16, num_local=3)
    seq = sequence(list(range(100, 120)))
    assert not kv.allocate_slots(seq, 16)  # 4 local blocks for one chunk: more than the pool
    assert seq.block_ids == [] and kv.pool.num_used_blocks == 0
    advance(kv, seq, 12)
    for _ in range(8):  # decoding, it never needs more than 3
        advance(kv, seq, 1)
    assert len(held(seq)) <= 3


@pytest.mark.parametrize("windows, backend", [([None, None], "cpu"), ([8, 8], "cpu"), ([8, None], "sdpa")])
def test_no_group_without_both_layer_kinds_or_off_the_paged_backends(windows, backend):
    assert windowed_kv_split(windows, 100, 16, 4, 64, backend) is None


def test_the_split_keeps_the_budget():
    # 5 local layers to 1 global, window 32, blocks of 16: 4 sequences x 3 blocks + 64 / 16 + 1 = 17 local
    split = windowed_kv_split([32] * 5 + [None], 100, 16, 4, 64, "triton")
    assert (split.num_local_blocks, split.num_blocks, split.window) == (17, 100 + 83 * 5, 32)
    assert split.num_local_blocks * 5 + split.num_blocks * 1 == 100 * 6  # the same bytes
    small = windowed_kv_split([32, None], 10, 16, 4, 64, "cpu")
    assert (small.num_local_blocks, small.num_blocks) == (10, 10)  # no room to split: as one group
