"""The CPU KV pool a job's engine gets when `engine.kv_cache_memory` is auto: what the job can use.

The engine's own auto rule (engine/kv/capacity.py) sizes for max_num_seqs sequences of max_model_len
tokens, capped at the smaller of 4 GiB and 20% of RAM. A job knows more, before any weight loads:

- sequences at once: at most max_num_seqs, and at most the job's input rows x n;
- tokens per sequence: at most max_model_len, and at most the longest prompt + sampling.max_tokens.
  The longest prompt is bounded without a tokenizer: a byte-level or byte-fallback tokenizer gives at
  most one token per UTF-8 byte of text (the prompt, or a row's message contents, and the system
  prompt), and the chat template adds at most TEMPLATE_MARGIN_TOKENS. The prompt column is read for
  this only while the job has at most MAX_SCANNED_ROWS rows; other prompt sources (a prompt template,
  tools, scoring and reward inputs, batch files, a per-row max_tokens) are bounded by max_model_len.

The bound is an upper bound for what runs at once, so it costs no concurrency; where it is loose (a
template longer than the margin) a request waits for blocks, as with any pool too small, and its
output is the same. A draft model (speculative.method draft_model) keeps as many tokens as the
target's pool: both share the budget and the cap (bytes per token of the two together). Stages of a
multi-stage job (a reward stage) run one engine at a time, each sized for its own stage.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from batchgen.engine.kv.capacity import auto_kv_bytes, cpu_kv_cap_bytes
from batchgen.pipeline.config import JobConfig
from batchgen.pipeline.output import WorkUnit
from batchgen.pipeline.reader import read_rows
from batchgen.pipeline.storage import Storage

log = logging.getLogger("batchgen.pipeline")

TEMPLATE_MARGIN_TOKENS = 128  # what a chat template adds around a prompt (role markers, a default system prompt)
MAX_SCANNED_ROWS = 1_000_000  # read the prompts to bound their length only up to this many rows


@dataclass(frozen=True)
class KvBudget:
    """The pool the job's engine gets and how it was found."""

    num_tokens: int  # the pool's tokens (whole blocks); a draft model's pool holds as many
    num_seqs: int  # sequences at once the bound allows for
    tokens_per_seq: int  # tokens per sequence the bound allows for
    bytes_per_token: int  # the target's
    cap_bytes: int
    max_model_len: int
    draft_bytes_per_token: int = 0

    @property
    def num_bytes(self) -> int:
        """The target's pool: what its engine.kv_cache_memory becomes."""
        return self.num_tokens * self.bytes_per_token

    @property
    def num_pool_bytes(self) -> int:
        """Both pools (target and draft) together."""
        return self.num_tokens * (self.bytes_per_token + self.draft_bytes_per_token)

    def describe(self) -> str:
        per_token = f"{self.bytes_per_token:,}" + (f" + {self.draft_bytes_per_token:,} (draft)"
                                                   if self.draft_bytes_per_token else "")
        num_bound = self.num_seqs * self.tokens_per_seq
        if self.num_tokens + 64 < num_bound:  # (whole blocks of up to 64 tokens aside)
            why = f"{self.num_tokens:,} tokens: the cap ({self.cap_bytes / 1e9:.2f} GB: 4 GiB or 20% of RAM)"
        elif self.num_tokens >= self.max_model_len > num_bound:
            why = f"{self.num_tokens:,} tokens: the minimum, one sequence of max_model_len"
        else:
            why = f"cap {self.cap_bytes / 1e9:.2f} GB not reached"
        return (f"{self.num_pool_bytes / 1e9:.3f} GB for the job's bound of {self.num_seqs} sequences x "
                f"{self.tokens_per_seq:,} tokens at {per_token} bytes/token ({why})")


def job_kv_budget(job: JobConfig, storage: Storage, units: list[WorkUnit], max_model_len: int,
                  bytes_per_token: int, draft_bytes_per_token: int = 0, ram: int | None = None) -> KvBudget:
    """The pool for this job's units (see the module docstring)."""
    num_rows = sum(u.num_rows for u in units)
    sampling = job.sampling
    per_row_n = "n" in job.sampling_columns or job.input.is_batch_file or sampling.beam_width > 1
    num_seqs = job.engine.max_num_seqs if per_row_n else min(job.engine.max_num_seqs, max(1, num_rows * sampling.n))
    tokens = max_model_len
    prompt_tokens = _prompt_token_bound(job, storage, units) if num_rows <= MAX_SCANNED_ROWS else None
    if prompt_tokens is not None and sampling.max_tokens is not None and "max_tokens" not in job.sampling_columns:
        tokens = min(max_model_len, prompt_tokens + sampling.max_tokens)
    total_per_token = bytes_per_token + draft_bytes_per_token
    cap = cpu_kv_cap_bytes(ram)
    block_size = job.engine.block_size
    both = auto_kv_bytes(num_seqs, tokens, total_per_token, block_size, max_model_len, cap)
    return KvBudget(both // (total_per_token * block_size) * block_size, num_seqs, tokens, bytes_per_token, cap,
                    max_model_len, draft_bytes_per_token)


def _prompt_token_bound(job: JobConfig, storage: Storage, units: list[WorkUnit]) -> int | None:
    """At most how many tokens the longest prompt renders to; None where this module does not bound it."""
    inp = job.input
    if job.task != "generate" or inp.is_batch_file or inp.prompt_template is not None or inp.tools \
            or inp.tools_column is not None:
        return None
    column = inp.prompt_column or inp.messages_column
    if column is None:
        return None
    longest = 0
    for unit in units:
        for batch in read_rows(storage, unit.file, unit.start, unit.stop, [column]):
            num_bytes = _text_bytes(batch.column(0), is_messages=inp.messages_column is not None)
            if num_bytes is None:
                return None
            longest = max(longest, num_bytes)
    system = len((inp.system_prompt or "").encode())
    return longest + system + TEMPLATE_MARGIN_TOKENS


def _text_bytes(values: pa.Array, is_messages: bool) -> int | None:
    """The most UTF-8 bytes of one row: a prompt's, or the sum of a row's message contents."""
    if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):  # a prompt, or messages as JSON
        lengths = pc.binary_length(values)
        longest = pc.max(lengths).as_py()
        return longest or 0
    if not is_messages:
        return None
    longest = 0
    for messages in values.to_pylist():
        total = 0
        for message in messages or []:
            content = message.get("content") if isinstance(message, dict) else None
            if content is None:
                continue
            if not isinstance(content, str):
                return None  # content parts (images, lists): not bounded here
            total += len(content.encode()) + TEMPLATE_MARGIN_TOKENS // 8  # each message's role markers
        longest = max(longest, total)
    return longest
