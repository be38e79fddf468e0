"""Batched sampler: penalties, min_tokens, greedy, temperature, top-k, top-p, min-p, seeded draws.

`Sampler.sample` reads a SamplingBatch (sampling_batch.py): per-row parameters as device tensors
and host flags saying which treatments any row needs, so it never asks the device (no `.any()`,
`.item()`, `.tolist()`); penalties read the device-side token counts of a PenaltyState. It returns
device tensors; the model runner reads them back in one copy.


Every random row draws its noise from the keyed generator (keyed_random.py): a pure function of
(job seed, request key, sample index, output position), one exponential race per token, so a sample
never depends on its batch mates, on preemption or on speculation.

A verify chunk (speculative decoding) hands 1 + k rows of one sequence; the batch already carries
each row's output position, penalty-count delta and min_tokens ban (sampling_batch.py), so every row
is sampled exactly as plain decoding would sample that position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.engine.core.sequence import Sequence
from batchgen.engine.sampling.keyed_random import (
    keyed_exponential,
    keyed_exponential_at,
    keyed_exponential_rows,
)
from batchgen.engine.sampling.sampling_batch import PenaltyState, SamplingBatch, sampling_batch_for
from batchgen.kernels import cpu_sampling


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """vLLM semantics: repetition over prompt+output tokens; presence/frequency over output tokens.

    The per-row reference (counts rebuilt from the token lists); the sampler uses PenaltyState.apply."""
    vocab = logits.shape[-1]
    for row, seq in enumerate(seqs):
        p = seq.params
        if not p.has_penalties:
            continue
        out_ids = torch.tensor(seq.output_token_ids, dtype=torch.long, device=logits.device)
        out_counts = torch.bincount(out_ids, minlength=vocab)[:vocab].to(logits.dtype)  # (V,)
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
            seen[torch.tensor(seq.prompt_token_ids, dtype=torch.long, device=logits.device)] = True
            seen |= out_counts > 0
            row_logits = logits[row]
            penalized = torch.where(row_logits > 0, row_logits / p.repetition_penalty,
                                    row_logits * p.repetition_penalty)
            logits[row] = torch.where(seen, penalized, row_logits)
        logits[row] -= p.frequency_penalty * out_counts + p.presence_penalty * (out_counts > 0).to(logits.dtype)
    return logits


def apply_min_tokens(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: tuple[int, ...]) -> torch.Tensor:
    """Bans EOS and stop tokens in rows below their min_tokens, in place: one index_put for the batch."""
    rows: list[int] = []
    cols: list[int] = []
    for row, seq in enumerate(seqs):
        if seq.num_output_tokens < seq.params.min_tokens:
            banned = list(eos_token_ids) + seq.params.stop_token_ids
            rows.extend([row] * len(banned))
            cols.extend(banned)
    if rows:
        logits[torch.tensor(rows), torch.tensor(cols)] = float("-inf")
    return logits


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, *,
                  has_top_k_or_p: bool | None = None, has_min_p: bool | None = None,
                  is_sorted: bool = False, log_z: torch.Tensor | None = None) -> torch.Tensor:
    """Set every token outside the top-k / nucleus / min-p set to -inf.

    logits: (N, V) already divided by temperature; top_k: (N,) int (V = off); top_p, min_p: (N,).
    `has_top_k_or_p` / `has_min_p`: whether any row filters so (the sampler knows it on the host);
    None asks the device, which waits for it.

    `is_sorted`: `logits` are instead each row's K largest tempered logits in descending order (the
    sampler's candidates, (N, K)), and no sort runs. A row's top-p mass is taken within its top-k set
    when top_k <= K, else against its whole distribution, whose log-normalizer `log_z` (N,) the caller
    passes (None: every top-p row has top_k <= K). Rows whose kept set reaches past the K candidates
    are the caller's to redo (`candidates_cover`).
    """
    if is_sorted:
        return _filter_sorted(logits, top_k, top_p, min_p, log_z, bool(has_top_k_or_p), bool(has_min_p))
    vocab = logits.shape[-1]
    if has_top_k_or_p is None:
        has_top_k_or_p = bool((top_k < vocab).any()) or bool((top_p < 1).any())
    if has_min_p is None:
        has_min_p = bool((min_p > 0).any())
    if has_top_k_or_p:
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)  # (N, V)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        remove = ranks >= top_k[:, None]
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
        # Drop a token when the mass before it already reaches top_p (the top token always stays).
        mass_before = probs.cumsum(dim=-1) - probs
        remove |= mass_before >= top_p[:, None]
        remove[:, 0] = False
        logits = logits.scatter(-1, sorted_idx, sorted_logits.masked_fill(remove, float("-inf")))
    if has_min_p:
        probs = logits.softmax(dim=-1)
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def _filter_sorted(candidates: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                   log_z: torch.Tensor | None, has_top_k_or_p: bool, has_min_p: bool) -> torch.Tensor:
    """filter_logits over sorted candidates (N, K). Masses are unnormalized weights relative to the top
    candidate and prefix sums, so a row's decisions do not depend on K (on what its batch mates ask)."""
    k = candidates.shape[1]
    weights = (candidates - candidates[:, :1]).exp()  # (N, K): p_i / p_top
    ranks = torch.arange(k, device=candidates.device)[None, :]
    remove = ranks >= top_k[:, None]
    if has_top_k_or_p:
        within = weights.masked_fill(remove, 0.0)
        mass = within.cumsum(dim=-1)  # (N, K) inclusive
        last = (top_k.clamp(max=k) - 1).long()[:, None]
        total = mass.gather(-1, last).squeeze(-1)  # (N,) the top-k set's mass
        if log_z is not None:  # rows past the candidates: the whole row's mass, exp(log Z - top logit)
            total = torch.where(top_k <= k, total, (log_z - candidates[:, 0]).exp())
        # Drop a token when the mass before it already reaches top_p (the top token always stays).
        remove |= (mass - within) >= top_p[:, None] * total[:, None]
        remove[:, 0] = False
    if has_min_p:
        remove |= weights < min_p[:, None]
    return candidates.masked_fill(remove, float("-inf"))


def candidates_cover(candidates: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                     log_z: torch.Tensor | None, vocab: int) -> torch.Tensor:
    """(N,) bool: whether each row's kept set lies within its K sorted candidates (N, K): a top-k <= K;
    or no top-k, and the candidates hold top_p of the whole row's mass (log_z) or end below min-p.
    (A top-k between K and the vocabulary renormalizes over more than the candidates: never covered.)"""
    k = candidates.shape[1]
    weights = (candidates - candidates[:, :1]).exp()  # (N, K): p_i / p_top
    is_unbounded = top_k >= vocab
    covered = (top_k <= k) | (is_unbounded & (min_p > 0) & (weights[:, -1] < min_p))
    if log_z is not None:
        holds_top_p = weights.sum(dim=-1) >= top_p * (log_z - candidates[:, 0]).exp()
        covered |= is_unbounded & (top_p < 1) & holds_top_p
    return covered


@dataclass
class Candidates:
    """Each row's candidate tokens and their weights (proportional to probability; 0: filtered out)."""

    token_ids: torch.Tensor  # (R, K) int64
    weights: torch.Tensor  # (R, K) float32


def race(probs: torch.Tensor | Candidates, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(R,) long: one draw from each row of `probs` (R, V), argmax(p / E) with E ~ Exp(1) keyed by
    (keys[r], positions[r]) (the exponential race, exact for any p; p may be unnormalized).

    `probs` as Candidates: each row's draw among its K candidate tokens alone, with their noise
    (keyed by token id, so the same values as in the dense draw: the same token either way).
    Where the filters left a small support, the noise is computed at the support's entries only.
    """
    if isinstance(probs, Candidates):
        noise = keyed_exponential_rows(keys, positions, probs.token_ids)  # (R, K)
        best = (probs.weights / noise).argmax(dim=-1, keepdim=True)
        return probs.token_ids.gather(-1, best).squeeze(-1)
    if probs.device.type != "cpu":  # one dense draw: counting the support would read the device
        return (probs / keyed_exponential(keys, positions, probs.shape[-1])).argmax(dim=-1)
    support = probs > 0
    num_support = int(support.sum())
    if 4 * num_support >= probs.numel():
        return (probs / keyed_exponential(keys, positions, probs.shape[-1])).argmax(dim=-1)
    rows, cols = support.nonzero(as_tuple=True)  # (M,), (M,)
    ratio = torch.zeros_like(probs)
    ratio[rows, cols] = probs[rows, cols] / keyed_exponential_at(keys[rows], positions[rows], cols)
    return ratio.argmax(dim=-1)


@dataclass
class SampledTokens:
    """The sampler's result, on the device. top_* hold zeros in rows that asked for no top logprobs."""

    tokens: torch.Tensor  # (N,) int64
    logprobs: torch.Tensor  # (N,) float32 raw log-probability of each chosen token
    top_ids: torch.Tensor | None = None  # (N, K) int64, K = the batch's largest logprobs N
    top_logprobs: torch.Tensor | None = None  # (N, K) float32


class Sampler:
    def __init__(self, eos_token_ids: tuple[int, ...], *, is_c_sampling: bool = False):
        """`is_c_sampling`: greedy picks and log Z through kernels/cpu_sampling.py (the engine passes
        its Capabilities' answer: CPU logits and the kernel built); otherwise torch's ops."""
        self.eos_token_ids = eos_token_ids
        self.is_c_sampling = is_c_sampling

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence],
                 draft_offsets: list[int] | None = None) -> tuple[list[int], list[float]]:
        """Sample outside an engine step (tests, tools): builds the batch and the penalty counts from
        `seqs` (one per row; `draft_offsets` as in add_sampling_sections), reads the result back.
        Returns tokens and their raw log-probabilities."""
        vocab = logits.shape[-1]
        penalties = PenaltyState(vocab, logits.device)
        batch = sampling_batch_for(seqs, self.eos_token_ids, vocab, penalties, logits.device, draft_offsets)
        out = self.sample(logits, batch, seqs, penalties)
        return out.tokens.tolist(), out.logprobs.tolist()

    @torch.no_grad()
    def sample(self, logits: torch.Tensor, batch: SamplingBatch, seqs: list[Sequence],
               penalties: PenaltyState) -> SampledTokens:
        """logits: (N, V) float32 raw model logits, one row per sequence (the sampler may edit them in
        place). Chosen tokens, their raw log-probabilities (the model's own, before any penalty) and
        the top-N raw log-probabilities where asked; the sampled tokens join `penalties`' counts.
        `seqs` are not read: every per-row value comes in `batch`."""
        num_rows, vocab = logits.shape
        result = SampledTokens(tokens=logits.new_empty(0, dtype=torch.long), logprobs=logits.new_empty(0))
        if batch.top_index is not None:  # before anything edits the logits
            index = batch.top_index.long()
            picked = logits.index_select(0, index)  # (L, V)
            k = min(batch.max_top_logprobs, vocab)
            values, ids = picked.topk(k, dim=-1)  # (L, k)
            values = values - torch.logsumexp(picked, dim=-1, keepdim=True)
            result.top_ids = ids.new_zeros((num_rows, k)).index_copy_(0, index, ids)
            result.top_logprobs = values.new_zeros((num_rows, k)).index_copy_(0, index, values)
        if self.is_c_sampling:
            tokens, log_z = cpu_sampling.argmax_log_z(logits)  # (N,), (N,): one pass over the raw logits
        else:
            tokens, log_z = None, torch.logsumexp(logits, dim=-1)
        # Penalties change logits a token could be drawn at: keep the raw ones. min_tokens only bans
        # tokens (to -inf), which are then never drawn, so the chosen tokens' raw logits survive it.
        raw = logits
        if batch.has_penalties:
            penalties.initialize(batch)
            logits = penalties.apply(logits, batch)
            tokens = None
        if batch.ban_index is not None:
            logits.index_put_((batch.ban_index.long(), batch.ban_tokens.long()),
                              logits.new_full((), float("-inf")))
            tokens = None
        is_all_random = len(batch.random_rows) == num_rows
        if tokens is None and not is_all_random:  # greedy rows keep these
            tokens = cpu_sampling.argmax(logits) if self.is_c_sampling else logits.argmax(dim=-1)
        if batch.random_rows:
            if is_all_random:  # no copy of the logits
                tokens = self.draw(logits, batch)
            else:
                rows = batch.random_index.long()
                tokens = tokens.index_copy(0, rows, self.draw(logits[rows], batch))
        result.tokens = tokens
        result.logprobs = raw.gather(-1, tokens[:, None]).squeeze(-1) - log_z
        if batch.has_penalties:
            penalties.record(tokens, batch)
        return result

    def draw(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """(R,) int64: one token per random row of `logits` (R, V) (raw, penalties and bans applied),
        tempered and filtered, by the keyed exponential race (keyed_random.py).

        Filtered rows draw among their K largest logits (torch.topk or, on the CPU, the C kernel's
        one pass; K from the host: the batch's
        largest bounded top-k, or MAX_CANDIDATES for rows filtered by top-p / min-p alone) instead of
        sorting the vocabulary; a row whose kept set reaches past its candidates (known on the host,
        or found on the device: a read, so a sync on CUDA) is drawn from its whole row instead.
        Either way its token is the one the dense race over the filtered distribution picks: the
        noise is keyed by token id and the kept set is the same."""
        temperature = batch.temperature[:, None]
        keys, positions = batch.random_keys(), batch.random_position.long()
        k = batch.num_candidates
        if k == 0:  # no row filters
            return race((logits / temperature).softmax(dim=-1), keys, positions)
        # (R, K) descending; with top-p against a whole row, that row's normalizer (a pass over it)
        if self.is_c_sampling:
            inv_temperature = (1.0 / batch.temperature) if batch.needs_full_mass else None
            values, ids, log_z = cpu_sampling.top_k_log_z(logits, k, inv_temperature)
        else:
            values, ids = logits.topk(k, dim=-1)
            log_z = torch.logsumexp(logits / temperature, dim=-1) if batch.needs_full_mass else None
        candidates = values / temperature
        kept = filter_logits(candidates, batch.top_k, batch.top_p, batch.min_p, has_top_k_or_p=batch.has_top_k_or_p,
                             has_min_p=batch.has_min_p, is_sorted=True, log_z=log_z)
        weights = (kept - kept[:, :1]).exp()  # (R, K): 0 past each row's kept set
        if logits.device.type == "cpu":
            # Every filter keeps a prefix of the sorted candidates: draw over the longest one alone
            # (the noise costs most; a read of the device would stall a GPU step, so only here).
            width = int((weights > 0).sum(dim=-1).max())
            ids, weights = ids[:, :width], weights[:, :width]
        tokens = race(Candidates(ids, weights), keys, positions)
        if batch.is_candidate_set_exact:
            return tokens
        covered = candidates_cover(candidates, batch.top_k, batch.top_p, batch.min_p, log_z, logits.shape[-1])
        redo = (~covered).nonzero().flatten()  # (M,): read on the host
        if redo.numel():
            scaled = logits[redo] / temperature[redo]
            probs = filter_logits(scaled, batch.top_k[redo], batch.top_p[redo], batch.min_p[redo],
                                  has_top_k_or_p=batch.has_top_k_or_p, has_min_p=batch.has_min_p).softmax(dim=-1)
            tokens[redo] = race(probs, keys[redo], positions[redo])
        return tokens
