"""The rows of a step whose score-head logits are kept: each pooling sequence's last prompt position,
in the step whose chunk reaches it.

A pooling request is one prompt-only sequence (it computes its prompt and samples nothing). Its chunks
fill KV like any prefill; the chunk that ends its prompt hands the runner that last position's flat index,
and the model returns the score head's logits for those rows only (R, num_labels), read back in the
step's one device-to-host copy and kept on the sequence (`Sequence.pooled`) until the output processor
makes its output.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchgen.engine.core.scheduler import ScheduledSeq
from batchgen.engine.core.sequence import Sequence
from batchgen.engine.runner.step_inputs import StepPacker, int_section


@dataclass
class PoolSections:
    """The step's pooled rows (sent only when any)."""

    pool_rows: list[int] = int_section()  # (R,) flat token index in the step's batch


def add_pool_sections(packer: StepPacker, order: list[ScheduledSeq], query_lens: list[int]) -> list[Sequence] | None:
    """The sequences (in `order`, the packed order, each `query_lens` tokens) whose chunk computes their
    prompt's last token this step, their rows packed as `q.pool_rows`; None when no chunk does."""
    sections = PoolSections()
    seqs = []
    flat_start = 0
    for s, num_tokens in zip(order, query_lens):
        seq = s.seq
        if seq.is_prompt_only and seq.num_computed_tokens + num_tokens == seq.num_tokens:
            sections.pool_rows.append(flat_start + num_tokens - 1)
            seqs.append(seq)
        flat_start += num_tokens
    if not seqs:
        return None
    packer.add_sections(sections, "q.")
    return seqs


def record_pooled(host: np.ndarray, seqs: list[Sequence]) -> None:
    """The read-back rows (R, num_labels) float32 into their sequences."""
    for seq, row in zip(seqs, host.tolist()):
        seq.pooled = row
