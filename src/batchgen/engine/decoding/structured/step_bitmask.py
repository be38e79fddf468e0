"""StepBitmask: one step's constrained rows filled on the host, sent in one copy, applied to the logits.

The model runner calls `apply` after it has launched the forward: on an accelerator the fill runs on
the host while the device computes. Only the constrained logits rows have a bitmask row, so a step
without a constraint does nothing here (no buffer, no copy), and a step with any constrained row
adds exactly one host-to-device copy: the (R, ceil(V / 32)) int32 bitmask (on the CPU, none).
Which logits row each bitmask row masks travels in the step's packed copy (sampling_batch.py
GrammarSections).

The host buffer is reused from step to step (pinned for CUDA): it is rewritten only after the
previous step's sampled tokens came back, which waits for the stream and so for its copy too.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from batchgen.engine.decoding.structured.bitmask import allocate_token_bitmask, apply_token_bitmask
from batchgen.engine.decoding.structured.grammar_state import GrammarState, fill_bitmasks
from batchgen.engine.decoding.structured.library import load_library
from batchgen.kernels import cpu_token_bitmask

# (state, its first bitmask row, the drafts its verify chunk checks): one per constrained sequence.
GrammarFill = tuple[GrammarState, int, Seq[int]]
# From this many constrained sequences on, their rows are filled by the library's thread pool in one
# call (as many threads as torch's) rather than in turn. On the 2-core VM at 62 rows the pool took
# 6.6 ms per step against 2.7 ms in turn (docs/benchmarks/history/structured-output.md): only large batches
# (vLLM's threshold) on machines with cores to spare gain from it.
PARALLEL_FILL_MIN_SEQS = 128


@dataclass
class MaskStats:
    """Steps with a constrained row, the rows masked, and the host time spent on them (fill, copy, apply;
    on an accelerator the copy and the apply are launched, not waited for)."""

    num_masked_steps: int = 0
    num_masked_rows: int = 0
    mask_seconds: float = 0.0
    fill_seconds: float = 0.0

    def as_dict(self) -> dict:
        steps = self.num_masked_steps
        return {"num_masked_steps": steps, "num_masked_rows": self.num_masked_rows,
                "mask_seconds": self.mask_seconds, "fill_seconds": self.fill_seconds,
                "mask_ms_per_step": 1000 * self.mask_seconds / steps if steps else 0.0,
                "masked_rows_per_step": self.num_masked_rows / steps if steps else 0.0}


class StepBitmask:
    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        self.pin = device.type == "cuda" and torch.cuda.is_available()
        self.host: torch.Tensor | None = None  # (rows, W) int32, grown on demand
        self._executor = None  # the library's thread pool, made at the first large fill
        self.stats = MaskStats()

    def _reserve(self, num_rows: int) -> torch.Tensor:
        # fill_bitmask wants room past a verify chunk's last row: one spare row.
        if self.host is None or self.host.shape[0] <= num_rows:
            size = max(num_rows + 1, 2 * (0 if self.host is None else self.host.shape[0]), 16)
            self.host = allocate_token_bitmask(size, self.vocab_size, pin_memory=self.pin)
        return self.host

    def _executor_for(self, num_fills: int):
        if num_fills < PARALLEL_FILL_MIN_SEQS or torch.get_num_threads() < 2:
            return None
        if self._executor is None:
            self._executor = load_library().LLExecutor(torch.get_num_threads())
        return self._executor

    def apply(self, logits: torch.Tensor, fills: list[GrammarFill], rows: torch.Tensor) -> None:
        """Mask `logits` (N, V) in place at `rows` ((R,) int32 on its device, the constrained logits rows
        in order): each state fills its rows (1 + drafts) of the host bitmask, then one copy, then the apply."""
        if self.host is None and self.device.type == "cpu":
            cpu_token_bitmask.is_available()  # the first use builds the C kernel: not a step's mask time
        start = time.perf_counter()
        num_rows = rows.shape[0]
        host = self._reserve(num_rows)
        fill_bitmasks(fills, host, self._executor_for(len(fills)))
        filled = time.perf_counter()
        bitmask = host[:num_rows]  # (R, W)
        if self.device.type != "cpu":
            bitmask = bitmask.to(self.device, non_blocking=self.pin)  # the one extra copy
        apply_token_bitmask(logits, bitmask, rows)
        stats = self.stats
        stats.num_masked_steps += 1
        stats.num_masked_rows += num_rows
        stats.fill_seconds += filled - start
        stats.mask_seconds += time.perf_counter() - start
