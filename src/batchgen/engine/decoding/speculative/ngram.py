"""N-gram prompt lookup: propose the tokens that followed the latest suffix's earlier occurrence.

For each sequence (prompt + output so far) find the longest suffix n-gram, n from
prompt_lookup_max down to prompt_lookup_min, that occurred earlier in the sequence, and propose up
to k tokens that followed its first occurrence (HF's prompt lookup decoding picks the same one).
No model: a few numpy passes over each sequence's tokens on the host.
"""

from __future__ import annotations

import numpy as np

from batchgen.engine.core.sequence import Sequence


def propose_ngram(token_ids: np.ndarray, num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to `num_tokens` proposed continuations of `token_ids` (L,) int32; [] when no n-gram matches.

    match[j] is True while the n tokens ending at j equal the sequence's last n tokens; it is
    narrowed one token further back per n, so the longest length costs max_n passes over L.
    """
    length = token_ids.shape[0]
    if length < min_n + 1 or num_tokens <= 0:
        return []
    # Candidate end positions j of an earlier occurrence: j < length - 1, so one token follows.
    match = token_ids[:length - 1] == token_ids[length - 1]  # (L-1,) n = 1
    best_end = -1
    best_n = 0
    for n in range(1, max_n + 1):
        if n > 1:
            # The occurrence ending at j extends back one more token: token j-n+1 == token L-n.
            shifted = np.zeros_like(match)
            shifted[n - 1:] = token_ids[:length - n] == token_ids[length - n]
            match &= shifted
        if n >= min_n:
            hits = np.flatnonzero(match)
            if hits.size == 0:
                break
            best_end, best_n = int(hits[0]), n
        if n + 1 > length - 1:
            break
    if best_n < min_n:
        return []
    start = best_end + 1
    return token_ids[start:start + num_tokens].tolist()


class NgramProposer:
    """Proposals for a step's speculating sequences from their own tokens."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[list[int]]:
        """Per sequence, up to num_tokens[i] draft tokens (possibly none)."""
        return [propose_ngram(np.asarray(seq.token_ids, dtype=np.int32), k, self.min_n, self.max_n)
                for seq, k in zip(seqs, num_tokens)]

    def retain(self, running: list[Sequence]) -> None:
        """Nothing is kept per sequence."""

    def release(self, seq: Sequence) -> None:
        """Nothing is kept per sequence."""
