"""Top-N log-probabilities per sampled position (SamplingParams.logprobs = N > 0), vLLM's raw mode.

They come from the model's raw logits, before penalties, min_tokens bans, temperature and filters,
like the chosen token's log-probability the sampler reports, so the two are comparable.
"""

from __future__ import annotations

import torch

from batchgen.engine.sequence import Sequence


@torch.no_grad()
def top_logprobs(logits: torch.Tensor, seqs: list[Sequence]) -> list[list[tuple[int, float]] | None]:
    """logits: (N, V) raw, one row per sequence. For each row, the params' N most likely
    (token id, log-probability) pairs, most likely first; None where the row asks for none.

    Read it before the sampler runs: the sampler may edit the logits in place.
    """
    result: list[list[tuple[int, float]] | None] = [None] * len(seqs)
    rows = [i for i, seq in enumerate(seqs) if seq.params.num_top_logprobs > 0]
    if not rows:
        return result
    index = torch.tensor(rows, device=logits.device)
    picked = logits[index].float()  # (R, V)
    k = min(max(seqs[i].params.num_top_logprobs for i in rows), picked.shape[-1])
    values, ids = picked.topk(k, dim=-1)  # (R, k)
    values = values - torch.logsumexp(picked, dim=-1, keepdim=True)
    values, ids = values.tolist(), ids.tolist()
    for j, i in enumerate(rows):
        num = seqs[i].params.num_top_logprobs
        result[i] = list(zip(ids[j][:num], values[j][:num]))
    return result
