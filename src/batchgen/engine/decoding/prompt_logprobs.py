"""Prompt log-probabilities, computed in the prefill chunks that run anyway.

A sequence that asks (SamplingParams.prompt_logprobs, or the continuation of a scored context) owes one
value per prompt token from its state's `start` (sequence.py PromptLogprobState): the log-probability
of token i given the tokens before it, read from the logits at position i - 1. Each step, every chunk
that covers such positions keeps those rows: the model hands back their final (normed) hidden states,
and the logits are made here a slice of rows at a time, so a long prompt never holds a (tokens,
vocabulary) tensor. The values go back to the host in the step's one read-back, beside the sampled
tokens.

A chunk only computes positions it runs, and a sequence only records positions in order: a chunked
prefill records its rows chunk by chunk, and a preempted sequence skips the rows it already has when it
is recomputed (the prefix cache gives it back only blocks before its first missing row; at admission
that is none: like vLLM, prompt tokens found in the cache are recomputed for their logits).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from batchgen.engine.core.outputs import Logprob, PromptLogprobs
from batchgen.engine.core.scheduler import ScheduledSeq
from batchgen.engine.core.sequence import Sequence
from batchgen.engine.runner.step_inputs import StepPacker, int_section

# Rows whose logits exist at once: 256 x a 49k vocabulary is 50 MB of float32 (128k: 130 MB).
ROWS_PER_SLICE = 256


@dataclass
class PromptLogprobSections:
    """The step's prompt positions whose logits give a prompt log-probability (sent only when any)."""

    prompt_rows: list[int] = int_section()  # (R,) flat token index in the step's batch
    prompt_targets: list[int] = int_section()  # (R,) the prompt token after that position


@dataclass
class PromptLogprobPlan:
    """Host side: which sequence each run of rows belongs to (rows in sequence order, contiguous)."""

    seqs: list[Sequence]
    counts: list[int]  # rows per sequence
    num_top: int  # the largest top N asked in the step

    @property
    def num_rows(self) -> int:
        return sum(self.counts)


def add_prompt_logprob_sections(packer: StepPacker, order: list[ScheduledSeq], query_lens: list[int]
                                ) -> PromptLogprobPlan | None:
    """The rows of this step's chunks (in `order`, the packed order, each `query_lens` tokens) at positions
    whose prompt log-probability their sequence still owes. None: no row this step."""
    sections = PromptLogprobSections()
    plan = PromptLogprobPlan([], [], 0)
    flat_start = 0
    for s, num_tokens in zip(order, query_lens):
        seq = s.seq
        if seq.num_prompt_logprob_rows:
            start = seq.num_computed_tokens
            first = seq.prompt_logprobs.position
            assert first >= start, f"{seq.request_id}: prompt position {first} owed but already computed"
            end = min(start + num_tokens, seq.num_prompt_tokens - 1)
            if first < end:
                sections.prompt_rows.extend(range(flat_start + first - start, flat_start + end - start))
                sections.prompt_targets.extend(seq.token_ids[first + 1:end + 1])
                plan.seqs.append(seq)
                plan.counts.append(end - first)
                plan.num_top = max(plan.num_top, seq.prompt_logprobs.num_top)
        flat_start += num_tokens
    if not plan.seqs:
        return None
    packer.add_sections(sections, "p.")
    return plan


def compute_prompt_logprobs(lm_head, hidden: torch.Tensor, targets: torch.Tensor, num_top: int) -> torch.Tensor:
    """(R, 2 + 2K) int32 on the device: each row's target log-probability (float32 bits), its rank (1: the
    most likely; 1 + the tokens with a larger logit), K top ids, K top log-probabilities (bits).

    hidden: (R, H) normed final hidden states; targets: (R,) int32; `lm_head` gives float logits."""
    out = []
    for first in range(0, hidden.shape[0], ROWS_PER_SLICE):
        logits = lm_head(hidden[first:first + ROWS_PER_SLICE]).float()  # (r, V)
        target = targets[first:first + ROWS_PER_SLICE].long()
        log_z = torch.logsumexp(logits, dim=-1)  # (r,)
        chosen = logits.gather(-1, target[:, None]).squeeze(-1)  # (r,)
        rank = (logits > chosen[:, None]).sum(dim=-1).to(torch.int32) + 1
        columns = [(chosen - log_z).view(torch.int32)[:, None], rank[:, None]]
        if num_top:
            values, ids = logits.topk(min(num_top, logits.shape[-1]), dim=-1)  # (r, K)
            columns += [ids.to(torch.int32), (values - log_z[:, None]).contiguous().view(torch.int32)]
        out.append(torch.cat(columns, dim=1))
    return torch.cat(out)


def record_prompt_logprobs(host: np.ndarray, plan: PromptLogprobPlan) -> None:
    """The read-back rows (R, 2 + 2K) int32 into their sequences' prompt log-probabilities."""
    floats = host.view(np.float32)
    logprobs = floats[:, 0].tolist()
    ranks = host[:, 1].tolist()
    k = (host.shape[1] - 2) // 2
    row = 0
    for seq, count in zip(plan.seqs, plan.counts):
        state = seq.prompt_logprobs
        state.logprobs.extend(logprobs[row:row + count])
        state.ranks.extend(ranks[row:row + count])
        n = state.num_top
        if n:
            ids = host[row:row + count, 2:2 + n].tolist()
            values = floats[row:row + count, 2 + k:2 + k + n].tolist()
            state.top_logprobs.extend([list(zip(i, v)) for i, v in zip(ids, values)])
        row += count


def prompt_logprobs_output(seq: Sequence, token_texts) -> PromptLogprobs:
    """vLLM's RequestOutput.prompt_logprobs for a finished sequence: None for the first prompt token (and
    any before its state's start), then {token id: Logprob}, the prompt's token first, then the top N.

    `token_texts`: ids -> each token's text decoded alone (Tokenizer.token_texts)."""
    prompt = seq.prompt_token_ids
    state = seq.prompt_logprobs
    start = state.start
    tops = state.top_logprobs or [[] for _ in state.logprobs]
    ids = prompt[start:] + [token_id for top in tops for token_id, _ in top]
    texts = dict(zip(ids, token_texts(ids))) if ids else {}
    out: PromptLogprobs = [None] * start
    for token_id, logprob, rank, top in zip(prompt[start:], state.logprobs, state.ranks, tops):
        entry = {token_id: Logprob(logprob, rank, texts[token_id])}
        for r, (top_id, top_logprob) in enumerate(top, start=1):
            entry.setdefault(top_id, Logprob(top_logprob, r, texts[top_id]))
        out.append(entry)
    return out
