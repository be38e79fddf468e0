"""Batched sampler: penalties, min_tokens, greedy, temperature, top-k, top-p, min-p, seeded draws.

Each sequence draws from its own generator (seeded by job seed, request id and sample index) with
one exponential race per token, so a sample never depends on its batch mates.
"""

from __future__ import annotations

import torch

from batchgen.engine.sequence import Sequence
from batchgen.kernels import cpu_sampling


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """vLLM semantics: repetition over prompt+output tokens; presence/frequency over output tokens."""
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


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Set every token outside the top-k / nucleus / min-p set to -inf.

    logits: (N, V) already divided by temperature; top_k: (N,) long (V = off); top_p, min_p: (N,).
    """
    vocab = logits.shape[-1]
    if bool((top_k < vocab).any()) or bool((top_p < 1).any()):
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)  # (N, V)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        remove = ranks >= top_k[:, None]
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
        # Drop a token when the mass before it already reaches top_p (the top token always stays).
        mass_before = probs.cumsum(dim=-1) - probs
        remove |= mass_before >= top_p[:, None]
        remove[:, 0] = False
        logits = logits.scatter(-1, sorted_idx, sorted_logits.masked_fill(remove, float("-inf")))
    if bool((min_p > 0).any()):
        probs = logits.softmax(dim=-1)
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


class Sampler:
    def __init__(self, eos_token_ids: tuple[int, ...], *, is_c_sampling: bool = False):
        """`is_c_sampling`: greedy picks and log Z through kernels/cpu_sampling.py (the engine passes
        its Capabilities' answer: CPU logits and the kernel built); otherwise torch's ops."""
        self.eos_token_ids = eos_token_ids
        self.is_c_sampling = is_c_sampling

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[float]]:
        """logits: (N, V) float32 raw model logits, one row per sequence (the sampler may edit them in
        place). Returns tokens and their raw log-probabilities (the model's own, before any penalty)."""
        if self.is_c_sampling:
            tokens, log_z = cpu_sampling.argmax_log_z(logits)  # (N,), (N,): one pass over the raw logits
        else:
            tokens, log_z = None, torch.logsumexp(logits, dim=-1)
        # Penalties change logits a token could be drawn at: keep the raw ones. min_tokens only bans
        # tokens (to -inf), which are then never drawn, so the chosen tokens' raw logits survive it.
        raw = logits
        if any(s.params.has_penalties for s in seqs):
            logits = apply_penalties(logits.clone(), seqs)
            tokens = None
        if any(s.num_output_tokens < s.params.min_tokens for s in seqs):
            logits = apply_min_tokens(logits, seqs, self.eos_token_ids)
            tokens = None
        if tokens is None:  # greedy rows keep these
            tokens = cpu_sampling.argmax(logits) if self.is_c_sampling else logits.argmax(dim=-1)
        random_rows = [i for i, s in enumerate(seqs) if not s.params.is_greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            params = [seqs[i].params for i in random_rows]
            vocab = logits.shape[-1]
            temperature = torch.tensor([p.temperature for p in params], device=logits.device)
            top_k = torch.tensor([vocab if p.top_k == -1 else min(p.top_k, vocab) for p in params], device=logits.device)
            top_p = torch.tensor([p.top_p for p in params], device=logits.device)
            min_p = torch.tensor([p.min_p for p in params], device=logits.device)
            scaled = logits[rows] / temperature[:, None]
            probs = filter_logits(scaled, top_k, top_p, min_p).softmax(dim=-1)  # (R, V)
            # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p; one draw per token per sequence.
            noise = torch.stack([
                torch.empty(vocab, device=logits.device).exponential_(generator=seqs[i].get_generator(logits.device))
                for i in random_rows])
            tokens[rows] = (probs / noise).argmax(dim=-1)
        chosen_logprobs = raw.gather(-1, tokens[:, None]).squeeze(-1) - log_z
        return tokens.tolist(), chosen_logprobs.tolist()
