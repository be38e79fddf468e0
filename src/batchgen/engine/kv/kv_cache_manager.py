"""KVCacheManager: sequence-level block bookkeeping on top of the BlockPool (prefix hits, slots)."""

from __future__ import annotations

from batchgen.engine.core.sequence import Sequence
from batchgen.engine.kv.block_pool import NO_PARENT, BlockPool, hash_block
from batchgen.engine.kv.window_groups import WindowedKV, window_start_block


def cache_slots(block_ids: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Flat cache slots (block * block_size + offset) of token positions start..end-1."""
    return [block_ids[pos // block_size] * block_size + pos % block_size for pos in range(start, end)]


class KVCacheManager:
    """Blocks per sequence: prefix-cache hits at admission, new blocks as tokens come, and sharing between
    a sequence and its forks (beams, the continuations of a scored context): a fork holds its parent's
    blocks (ref counts), and the first write into a block someone else also holds copies it first
    (copy on write; the (source, destination) pairs go to the step as `take_copies`)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 windowed: WindowedKV | None = None):
        """`num_blocks`: the pool of the full block tables. `windowed`: the sliding-window layers' own block
        group (kv/window_groups.py; its num_blocks is then this pool's), None: one group for every layer."""
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.pending_copies: list[tuple[int, int]] = []  # (source block, destination block) for the next step
        # The local layers' pool: each sequence's local_block_ids index it, and its blocks before the window
        # of the next query go back as the sequence advances.
        self.windowed = windowed
        self.local_pool = BlockPool(windowed.num_local_blocks, enable_prefix_caching) if windowed else None
        self.pending_local_copies: list[tuple[int, int]] = []
        # Positions a sequence may step back by after a step is scheduled, beyond rejected drafts (which
        # never go below the step's start): a draft model's mirror rolls back its rejected proposals
        # (speculative/draft_model.py sets it). Local blocks are freed only this far behind the window.
        self.lookback_tokens = 0

    def _block_keys(self, seq: Sequence, num_full_blocks: int) -> list[tuple]:
        """Chained keys of the first `num_full_blocks` blocks of `seq`, extending its memo."""
        bs = self.block_size
        while len(seq.block_hashes) < num_full_blocks:
            i = len(seq.block_hashes)
            # An adapter's KV differs from the base's for the same tokens: its chain starts from its id.
            parent = hash(seq.block_hashes[-1]) if seq.block_hashes else \
                (hash(("lora", seq.lora_int_id)) if seq.lora_int_id else NO_PARENT)
            seq.block_hashes.append(hash_block(parent, tuple(seq.token_ids[i * bs:(i + 1) * bs])))
        return seq.block_hashes[:num_full_blocks]

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """The longest run of cached full blocks that prefixes `seq` (at least one token left to compute)."""
        if not self.pool.enable_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        if seq.num_prompt_logprob_rows:
            # Cached positions give no logits: a sequence still owing prompt log-probabilities takes only
            # the blocks before the first position it owes (none at first, as vLLM: it recomputes them).
            max_blocks = min(max_blocks, seq.prompt_logprobs.position // self.block_size)
        hits = []
        for key in self._block_keys(seq, max_blocks):
            block_id = self.pool.lookup(key)
            if block_id is None:
                break
            hits.append(block_id)
        if self.local_pool is not None:
            del hits[self._num_local_hits(seq, len(hits)):]
        return hits

    def _num_local_hits(self, seq: Sequence, num_hits: int) -> int:
        """The longest prefix hit of at most `num_hits` blocks whose local blocks inside the window of its
        first computed position are cached too (those before it are never read). A missing local block m
        rules out every hit that reads it; the next candidate is m blocks (vLLM's sliding-window lookup)."""
        keys = seq.block_hashes
        while num_hits > 0:
            first = self._local_window_start(num_hits * self.block_size)
            missing = next((i for i in range(num_hits - 1, first - 1, -1)
                            if self.local_pool.lookup(keys[i]) is None), None)
            if missing is None:
                return num_hits
            num_hits = missing
        return 0

    def _local_window_start(self, num_computed_tokens: int) -> int:
        """The first local block the sequence's next query (at num_computed_tokens, or up to lookback_tokens
        before it) reads."""
        return window_start_block(max(0, num_computed_tokens - self.lookback_tokens), self.windowed.window,
                                  self.block_size)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       computed_blocks: list[int] | None = None) -> bool:
        """Give `seq` blocks for `num_new_tokens` more tokens; False (nothing changed) when they don't fit.

        `computed_blocks` (from `get_computed_blocks`, possibly empty) marks an admission; the prefix
        cache's query/hit counters count admissions only.

        Blocks that become full with these tokens are registered in the prefix cache now, as vLLM v1
        does: their KV is written by this step's forward before any attention reads it, so a request
        scheduled later in the same step can share them.
        """
        is_admission = computed_blocks is not None
        local = self.local_pool
        if local is not None and not is_admission:
            self._free_outside_window(seq)
        needs_copy = not is_admission and self._shares_next_write(seq, self.pool, seq.block_ids)
        needs_local_copy = (local is not None and not is_admission
                            and self._shares_next_write(seq, local, seq.local_block_ids))
        if not is_admission and not needs_copy and not needs_local_copy:
            # A running sequence: most steps its new tokens fit its last block.
            total_tokens = seq.num_computed_tokens + num_new_tokens
            if total_tokens <= len(seq.block_ids) * self.block_size:
                self._cache_full_blocks(seq, total_tokens)
                return True
        computed_blocks = computed_blocks or []
        num_cached_tokens = len(computed_blocks) * self.block_size
        total_tokens = max(seq.num_computed_tokens, num_cached_tokens) + num_new_tokens
        num_required = -(-total_tokens // self.block_size)
        num_new_blocks = num_required - len(seq.block_ids) - len(computed_blocks)
        num_revived = sum(1 for b in computed_blocks if self.pool.ref_counts[b] == 0)
        if num_new_blocks + num_revived + needs_copy > self.pool.num_free_blocks:
            return False
        if local is not None:
            # The local table has the full one's length; at admission (an empty table) its entries before
            # the first computed position's window stay freed, the hit's blocks inside it are revived.
            num_local_freed = min(self._local_window_start(num_cached_tokens), len(computed_blocks)) \
                if is_admission else seq.num_local_freed
            local_hits = [local.lookup(key) for key in seq.block_hashes[num_local_freed:len(computed_blocks)]] \
                if is_admission else []
            num_local_new = num_required - max(len(seq.local_block_ids), len(computed_blocks))
            num_local_revived = sum(1 for b in local_hits if local.ref_counts[b] == 0)
            if max(num_local_new, 0) + num_local_revived + needs_local_copy > local.num_free_blocks:
                return False
        if needs_copy:
            self._copy_on_write(seq, self.pool, seq.block_ids, self.pending_copies)
        for block_id in computed_blocks:
            self.pool.touch(block_id)
        seq.block_ids.extend(computed_blocks)
        if num_new_blocks > 0:
            seq.block_ids.extend(self.pool.allocate(num_new_blocks))
        if local is not None:
            if needs_local_copy:
                self._copy_on_write(seq, local, seq.local_block_ids, self.pending_local_copies)
            if is_admission:
                for block_id in local_hits:
                    local.touch(block_id)
                seq.local_block_ids = [0] * num_local_freed + local_hits
                seq.num_local_freed = num_local_freed
            if num_local_new > 0:
                seq.local_block_ids.extend(local.allocate(num_local_new))
        self._cache_full_blocks(seq, total_tokens)
        if is_admission and self.pool.enable_caching:
            # Counted here, once per admission, not at lookup: a head-of-line request that does not
            # fit yet is looked up again every step and would inflate the hit rate's denominator.
            self.pool.num_queried_blocks += (seq.num_tokens - 1) // self.block_size
            self.pool.num_hit_blocks += len(computed_blocks)
        return True

    def _free_outside_window(self, seq: Sequence) -> None:
        """Give back the sequence's local blocks before its next query's window: no later step reads them
        (num_computed_tokens only grows until a preemption frees everything; see lookback_tokens). Their
        entries become block 0; a freed block keeps its prefix-cache key, as any freed block does."""
        start = min(self._local_window_start(seq.num_computed_tokens), len(seq.local_block_ids))
        if start > seq.num_local_freed:
            table = seq.local_block_ids
            self.local_pool.free(list(reversed(table[seq.num_local_freed:start])))
            table[seq.num_local_freed:start] = [0] * (start - seq.num_local_freed)
            seq.num_local_freed = start

    def _cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        if not self.pool.enable_caching:
            return
        num_full = min(num_tokens, seq.num_tokens) // self.block_size
        if num_full <= seq.num_registered_blocks:
            return  # most decode steps fill no block; skip the key list copy
        if seq.num_pending_tokens:
            # Only blocks of known tokens: a pending one (async scheduling) has no id to hash yet; its
            # block is registered when it is read back (cache_computed_blocks).
            num_full = min(num_full, seq.num_known_tokens // self.block_size)
            if num_full <= seq.num_registered_blocks:
                return
        keys = self._block_keys(seq, num_full)
        for i in range(seq.num_registered_blocks, num_full):
            if self.pool.block_keys[seq.block_ids[i]] is None:
                self.pool.cache_block(seq.block_ids[i], keys[i])
        if self.local_pool is not None:  # the local blocks still held (a freed one was never registered)
            local, table = self.local_pool, seq.local_block_ids
            for i in range(max(seq.num_registered_blocks, seq.num_local_freed), num_full):
                if local.block_keys[table[i]] is None:
                    local.cache_block(table[i], keys[i])
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)

    def _shares_next_write(self, seq: Sequence, pool: BlockPool, table: list[int]) -> bool:
        """Whether the block of `table` the sequence writes next is held by another sequence too. Only that
        one can be: a fork shares its parent's blocks up to the fork point, and full blocks are never written."""
        i = seq.num_computed_tokens // self.block_size
        return i < len(table) and pool.ref_counts[table[i]] > 1

    def _copy_on_write(self, seq: Sequence, pool: BlockPool, table: list[int],
                       pending: list[tuple[int, int]]) -> None:
        """A private copy of the shared block the sequence writes next (the caller checked a block is free)."""
        i = seq.num_computed_tokens // self.block_size
        source = table[i]
        (copy,) = pool.allocate(1)
        pool.free([source])  # the others keep it
        table[i] = copy
        pending.append((source, copy))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` (the parent's tokens, maybe more after them) holds the parent's blocks and counts its
        computed tokens: its first write into a block still shared copies it (allocate_slots)."""
        child.block_ids = list(parent.block_ids)
        child.lora_int_id = parent.lora_int_id  # a scored context's continuations run its adapter
        for block_id in child.block_ids:
            self.pool.ref_counts[block_id] += 1
        if self.local_pool is not None:
            child.local_block_ids = list(parent.local_block_ids)
            child.num_local_freed = parent.num_local_freed
            for block_id in child.local_block_ids[child.num_local_freed:]:
                self.local_pool.ref_counts[block_id] += 1
        child.num_computed_tokens = parent.num_computed_tokens
        num_shared_full = min(parent.num_tokens, child.num_tokens) // self.block_size
        child.block_hashes = list(parent.block_hashes[:num_shared_full])
        child.num_registered_blocks = min(parent.num_registered_blocks, num_shared_full)

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Offer the prefix cache the full blocks of computed tokens whose ids are now known: under async
        scheduling a block completed by a pending token is registered once the token is read back, so
        the cache holds what it would after in-order steps."""
        self._cache_full_blocks(seq, seq.num_computed_tokens)

    def take_copies(self) -> list[tuple[int, int]]:
        """The block copies the next step runs before its forward (copy on write), and forgets them; with a
        local pool, its copies as (pool.num_blocks + source, pool.num_blocks + destination)."""
        copies, self.pending_copies = self.pending_copies, []
        if self.pending_local_copies:
            # One list for the step: a local block's id follows the global pool's (the runner splits them).
            offset = self.pool.num_blocks
            copies += [(source + offset, dest + offset) for source, dest in self.pending_local_copies]
            self.pending_local_copies = []
        return copies

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks wholly past the sequence's known tokens (a verify chunk's rejected
        drafts ran into them). They hold no verified token, so none is in the prefix cache."""
        num_needed = -(-seq.num_tokens // self.block_size)
        if len(seq.block_ids) > num_needed:
            self.pool.free(list(reversed(seq.block_ids[num_needed:])))
            del seq.block_ids[num_needed:]
            if self.local_pool is not None:  # past the known tokens: inside the window, never freed before
                self.local_pool.free(list(reversed(seq.local_block_ids[num_needed:])))
                del seq.local_block_ids[num_needed:]

    def free(self, seq: Sequence) -> None:
        # Tail first, so a request's later blocks are evicted before the prefix others may share.
        self.pool.free(list(reversed(seq.block_ids)))
        seq.block_ids = []
        seq.num_registered_blocks = 0
        if self.local_pool is not None:
            self.local_pool.free(list(reversed(seq.local_block_ids[seq.num_local_freed:])))
            seq.local_block_ids = []
            seq.num_local_freed = 0
