"""Order a window of requests for the engine: shared prefixes together, similar lengths together.

Requests that share a prefix arriving back to back find its KV blocks still cached (a prefix hit
instead of a recompute); neighbours of similar length finish together, so a batch does not idle
on one long straggler. The writer restores input order, so this order is free to choose.

How: sort the window's token ids lexicographically (a trie walk: shared prefixes become adjacent),
cut it into groups whose neighbours share at least one KV block beyond what the whole window shares
(a chat template header is shared by all and cached anyway), sort each group by length, then order
the groups by their mean length. A prompt that shares nothing is a group of one, so unrelated
prompts end up sorted by length.
"""

from __future__ import annotations

import itertools

from batchgen.engine.text.token_prefix import num_shared_prefix
from batchgen.pipeline.request_builder import RowTask


def order_window(tasks: list[RowTask], sort_by_length: bool, block_size: int = 16) -> list[RowTask]:
    """The order to hand `tasks` (all with token ids) to the engine; input order when not sorting."""
    if not sort_by_length or len(tasks) < 2:
        return list(tasks)
    # Rows of different LoRA adapters share no KV blocks (the adapter is part of a block's hash): each
    # adapter's rows form their own trie.
    trie = sorted(tasks, key=lambda t: (t.lora_name or "", t.token_ids))
    # The lexicographically first and last token ids share exactly what every member shares.
    first, last = (trie[0], trie[-1]) if trie[0].lora_name == trie[-1].lora_name else (
        min(trie, key=lambda t: t.token_ids), max(trie, key=lambda t: t.token_ids))
    num_common = num_shared_prefix(first.token_ids, last.token_ids)
    threshold = num_common + block_size
    groups: list[list[RowTask]] = [[trie[0]]]
    for prev, cur in itertools.pairwise(trie):
        if prev.lora_name == cur.lora_name and \
                num_shared_prefix(prev.token_ids, cur.token_ids, cap=threshold) >= threshold:
            groups[-1].append(cur)
        else:
            groups.append([cur])
    for group in groups:
        group.sort(key=lambda t: len(t.token_ids))
    groups.sort(key=lambda g: sum(len(t.token_ids) for t in g) / len(g))
    return [t for g in groups for t in g]

