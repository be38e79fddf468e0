"""BlockPool: a fixed pool of KV blocks with ref counts, an LRU free queue and a prefix hash table.

A full block carries the chained hash h(parent_hash, block_token_ids). A freed block keeps its
hash (and its KV) until the pool hands it out again, so a later request can revive it.
"""

from __future__ import annotations

from collections import OrderedDict

NO_PARENT = 0


def hash_block(parent_hash: int, token_ids: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    """The key of a full block, chained through the parent.

    Dict equality compares this block's tokens exactly; the prefix before it is represented by the
    parent key's 64-bit builtin hash, so a false hit needs two different prefixes with equal hashes
    followed by an identical block (odds about n^2 / 2^64 for n cached blocks).
    """
    return (parent_hash, token_ids)


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"the KV block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.block_keys: list[tuple | None] = [None] * num_blocks
        # Free blocks, least recently freed first; ref-0 cached blocks stay here until evicted.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[tuple, int] = {}  # block key -> block id
        self.num_evictions = 0
        self.num_queried_blocks = 0
        self.num_hit_blocks = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def lookup(self, key: tuple) -> int | None:
        return self.cached.get(key) if self.enable_caching else None

    def touch(self, block_id: int) -> None:
        """Take a reference on a cached block (reviving it from the free queue if needed)."""
        if self.ref_counts[block_id] == 0:
            del self.free_queue[block_id]
        self.ref_counts[block_id] += 1

    def allocate(self, num_blocks: int) -> list[int]:
        """Pop `num_blocks` blocks off the LRU end; the caller checked `num_free_blocks` first."""
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self.free_queue.popitem(last=False)
            key = self.block_keys[block_id]
            if key is not None:  # evict the cached content this block still held
                del self.cached[key]
                self.block_keys[block_id] = None
                self.num_evictions += 1
            self.ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def cache_block(self, block_id: int, key: tuple) -> int:
        """Register a full block under `key`; returns the block id that now holds that key."""
        if not self.enable_caching:
            return block_id
        existing = self.cached.get(key)
        if existing is not None:
            return existing  # an identical block is already cached; keep ours private
        self.cached[key] = block_id
        self.block_keys[block_id] = key
        return block_id

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference on each block; free them in the given order (caller passes tail first)."""
        for block_id in block_ids:
            self.ref_counts[block_id] -= 1
            assert self.ref_counts[block_id] >= 0, f"block {block_id} freed twice"
            if self.ref_counts[block_id] == 0:
                self.free_queue[block_id] = None
