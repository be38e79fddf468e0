"""KVCacheManager: sequence-level block bookkeeping on top of the BlockPool (prefix hits, slots)."""

from __future__ import annotations

from batchgen.engine.core.sequence import Sequence
from batchgen.engine.kv.block_pool import NO_PARENT, BlockPool, hash_block


def cache_slots(block_ids: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Flat cache slots (block * block_size + offset) of token positions start..end-1."""
    return [block_ids[pos // block_size] * block_size + pos % block_size for pos in range(start, end)]


class KVCacheManager:
    """Blocks per sequence: prefix-cache hits at admission, new blocks as tokens come, and sharing between
    a sequence and its forks (beams, the continuations of a scored context): a fork holds its parent's
    blocks (ref counts), and the first write into a block someone else also holds copies it first
    (copy on write; the (source, destination) pairs go to the step as `take_copies`)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.pending_copies: list[tuple[int, int]] = []  # (source block, destination block) for the next step

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
        return hits

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
        needs_copy = not is_admission and self._shares_next_write(seq)
        if not is_admission and not needs_copy:  # a running sequence: most steps its new tokens fit its last block
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
        if needs_copy:
            self._copy_on_write(seq)
        for block_id in computed_blocks:
            self.pool.touch(block_id)
        seq.block_ids.extend(computed_blocks)
        if num_new_blocks > 0:
            seq.block_ids.extend(self.pool.allocate(num_new_blocks))
        self._cache_full_blocks(seq, total_tokens)
        if is_admission and self.pool.enable_caching:
            # Counted here, once per admission, not at lookup: a head-of-line request that does not
            # fit yet is looked up again every step and would inflate the hit rate's denominator.
            self.pool.num_queried_blocks += (seq.num_tokens - 1) // self.block_size
            self.pool.num_hit_blocks += len(computed_blocks)
        return True

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
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)

    def _shares_next_write(self, seq: Sequence) -> bool:
        """Whether the block the sequence writes next is held by another sequence too. Only that one can
        be: a fork shares its parent's blocks up to the fork point, and full blocks are never written."""
        i = seq.num_computed_tokens // self.block_size
        return i < len(seq.block_ids) and self.pool.ref_counts[seq.block_ids[i]] > 1

    def _copy_on_write(self, seq: Sequence) -> None:
        """A private copy of the shared block the sequence writes next (the caller checked a block is free)."""
        i = seq.num_computed_tokens // self.block_size
        source = seq.block_ids[i]
        (copy,) = self.pool.allocate(1)
        self.pool.free([source])  # the others keep it
        seq.block_ids[i] = copy
        self.pending_copies.append((source, copy))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` (the parent's tokens, maybe more after them) holds the parent's blocks and counts its
        computed tokens: its first write into a block still shared copies it (allocate_slots)."""
        child.block_ids = list(parent.block_ids)
        child.lora_int_id = parent.lora_int_id  # a scored context's continuations run its adapter
        for block_id in child.block_ids:
            self.pool.ref_counts[block_id] += 1
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
        """The block copies the next step runs before its forward (copy on write), and forgets them."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks wholly past the sequence's known tokens (a verify chunk's rejected
        drafts ran into them). They hold no verified token, so none is in the prefix cache."""
        num_needed = -(-seq.num_tokens // self.block_size)
        if len(seq.block_ids) > num_needed:
            self.pool.free(list(reversed(seq.block_ids[num_needed:])))
            del seq.block_ids[num_needed:]

    def free(self, seq: Sequence) -> None:
        # Tail first, so a request's later blocks are evicted before the prefix others may share.
        self.pool.free(list(reversed(seq.block_ids)))
        seq.block_ids = []
        seq.num_registered_blocks = 0
