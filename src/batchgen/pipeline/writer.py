"""Stream each unit's results into its part file in input order, then commit it atomically with its record.

Rows finish out of order (the feeder reorders a window, short requests finish first); each unit keeps
the rows that finished ahead of an earlier one, appends the in-order prefix to a Parquet writer open on
the unit's temp file every FLUSH_ROWS output rows, and commits the part when its last row is written. Memory
is bounded by the ordering window, not by the unit: a unit of a million rows holds what one of a
thousand holds.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.engine import RequestOutput, ScoreOutput
from batchgen.engine.text.tools import parse_tool_output
from batchgen.metrics import metric_column, metric_fields_of
from batchgen.pipeline.json_columns import json_field_names
from batchgen.pipeline.metric_columns import MetricScorer
from batchgen.pipeline.output import CheckpointWriter, CommitContext, IdChecksum, WorkUnit
from batchgen.pipeline.request_builder import RowTask
from batchgen.pipeline.reward_job import reward_error_row, reward_rows
from batchgen.pipeline.schema import (
    GENERATED_FIELDS,
    LORA_FIELD,
    REWARD_FIELDS,
    SCORE_FIELDS,
)
from batchgen.pipeline.storage import PartFile, Storage

# Output rows per write (one Parquet row group each): rows wait as Python objects (~10 KB for a row of
# 256 tokens) until written, so a unit's memory is this plus the rows that finished out of order.
FLUSH_ROWS = 512
FLUSH_TOKENS = 128 * 1024  # or fewer rows when their completions are long


def sample_rows(task: RowTask, out: RequestOutput) -> list[dict]:
    """One output row per sample, with the design's latency definitions (monotonic seconds)."""
    arrival = out.metrics.arrival_time
    rows = []
    for c in sorted(out.outputs, key=lambda c: c.index):
        num_tokens = len(c.token_ids)
        has_tokens = c.first_token_time is not None
        completion = c.content if c.content is not None else c.text
        finish_reason, tool_calls = c.finish_reason, None
        if task.tool_parser is not None:
            completion, calls, finish_reason = parse_tool_output(task.tool_parser, completion, finish_reason)
            tool_calls = None if calls is None else json.dumps([call.to_openai() for call in calls], ensure_ascii=False)
        rows.append({
            "sample_index": c.index,
            "completion": completion,
            "reasoning": c.reasoning_content,
            "reasoning_tokens": c.num_reasoning_tokens,
            "tool_calls": tool_calls,
            "completion_token_ids": list(c.token_ids),
            "finish_reason": finish_reason,
            "prompt_tokens": len(out.prompt_token_ids),
            "cached_tokens": out.num_cached_tokens,
            "completion_tokens": num_tokens,
            "cumulative_logprob": c.cumulative_logprob,
            "token_logprobs": c.logprobs,
            "top_logprobs": None if c.top_logprobs is None else [[t._asdict() for t in position]
                                                                 for position in c.top_logprobs],
            "queue_s": None if c.first_scheduled_time is None else c.first_scheduled_time - arrival,
            "ttft_s": c.first_token_time - arrival if has_tokens else None,
            "tpot_s": (c.last_token_time - c.first_token_time) / (num_tokens - 1) if num_tokens >= 2 else None,
            "e2e_s": c.last_token_time - arrival if has_tokens else None,
            "num_accepted_tokens": c.num_accepted_tokens,
            "error": c.error,
        })
    return rows


def error_rows(task: RowTask, n: int) -> list[dict]:
    """n rows for a request that never ran (its own n where its settings were read): finish_reason
    error, the message, nothing generated."""
    if task.params is not None:
        n = task.params.n
    row = {f.name: None for f in GENERATED_FIELDS}  # every column; the schema picks its own
    row.update(finish_reason="error", error=task.error, prompt_tokens=task.num_prompt_tokens,
               cached_tokens=0, completion_tokens=0)
    return [{**row, "sample_index": i} for i in range(n)]


def score_rows(out: ScoreOutput) -> list[dict]:
    """The one row of a scored context (task: loglikelihood): per continuation, in the order given."""
    arrival = out.metrics.arrival_time
    scores = out.continuations
    return [{
        "sample_index": 0,
        "continuation_logprob": [c.sum_logprob for c in scores],
        "continuation_num_tokens": [c.num_tokens for c in scores],
        "is_greedy": [c.is_greedy for c in scores],
        "continuation_token_ids": [list(c.token_ids) for c in scores],
        "continuation_token_logprobs": [list(c.logprobs) for c in scores],
        "finish_reason": "stop",
        "prompt_tokens": len(out.prompt_token_ids),
        "cached_tokens": out.num_cached_tokens,
        "completion_tokens": sum(c.num_tokens for c in scores),
        "queue_s": None if out.metrics.first_scheduled_time is None else out.metrics.first_scheduled_time - arrival,
        "e2e_s": out.metrics.last_token_time - arrival,
        "error": None,
    }]


def score_error_rows(task: RowTask) -> list[dict]:
    """The row of a context that could not be scored: finish_reason error, the message, null scores."""
    row = {f.name: None for f in SCORE_FIELDS}
    row.update(sample_index=0, finish_reason="error", error=task.error, prompt_tokens=task.num_prompt_tokens,
               cached_tokens=0, completion_tokens=0)
    return [row]


def checkpoint_schema(schema: pa.Schema) -> pa.Schema:
    """The columns a row dict holds (the generated ones): what a checkpoint keeps of a finished request."""
    generated = {f.name for f in GENERATED_FIELDS} | {f.name for f in SCORE_FIELDS}
    return pa.schema([f for f in schema if f.name in generated])


def _set_line(rows: list[dict], line: str) -> None:
    """A request's output line goes on its sample 0 row (rows come sorted by sample index)."""
    for i, row in enumerate(rows):
        row["openai_line"] = line if i == 0 else None


class UnitPart:
    """One unit on its way to its part file: input-side columns, finished rows, the open Parquet writer."""

    def __init__(self, unit: WorkUnit, file: PartFile, schema: pa.Schema, score_metrics: MetricScorer | None = None,
                 is_reward: bool = False):
        self.unit = unit
        self.file = file
        self.schema = schema
        self.score_metrics = score_metrics
        generated = {f.name for f in GENERATED_FIELDS} | {f.name for f in SCORE_FIELDS} | {LORA_FIELD.name}
        if is_reward:  # a reward job may keep a `completion` column: only its own columns are generated
            generated = {f.name for f in REWARD_FIELDS}
        metric_columns = {metric_column(name) for name in metric_fields_of(schema)} | json_field_names(schema)
        self.sources_schema = pa.schema([f for f in schema if f.name not in generated | metric_columns])  # id, kept
        self.rows_schema = pa.schema([f for f in schema if f.name not in metric_columns])  # without verdicts
        self.writer: pq.ParquetWriter | None = None
        self.sources: deque[pa.RecordBatch] = deque()  # id + kept columns of unwritten rows, input order
        self.ready: dict[int, list[dict]] = {}  # rows that finished before an earlier row of the unit
        self.pending: list[list[dict]] = []  # the in-order prefix not yet written
        self.restored: set[int] = set()  # offsets whose rows came from a checkpoint (not this run's work)
        self.pending_restored: list[bool] = []  # per pending request: taken from a checkpoint
        self.num_pending_rows = 0
        self.num_pending_tokens = 0
        self.next_offset = 0  # the first input row (within the unit) not yet moved to `pending`
        self.num_rows = 0  # output rows written
        self.ids = IdChecksum()

    @property
    def is_complete(self) -> bool:
        return self.next_offset == self.unit.num_rows

    def set_rows(self, offset: int, rows: list[dict]) -> None:
        assert offset >= self.next_offset and offset not in self.ready, \
            f"row {offset} of unit {self.unit.index} finished twice"
        self.ready[offset] = rows
        while self.next_offset in self.ready:
            done = self.ready.pop(self.next_offset)
            self.pending.append(done)
            self.pending_restored.append(self.next_offset in self.restored)
            self.restored.discard(self.next_offset)
            self.num_pending_rows += len(done)
            self.num_pending_tokens += sum(r["completion_tokens"] for r in done)
            self.next_offset += 1

    @property
    def should_flush(self) -> bool:
        return self.num_pending_rows >= FLUSH_ROWS or self.num_pending_tokens >= FLUSH_TOKENS or (
            self.is_complete and bool(self.pending))

    def flush(self) -> pa.Table:
        """Write the pending rows (with their id and kept columns) as one row group; returns those this run
        generated (not the ones taken from a checkpoint)."""
        source = self._take_sources(len(self.pending))
        counts = np.array([len(r) for r in self.pending])
        taken = source.take(pa.array(np.repeat(np.arange(len(counts)), counts)))
        rows = [row for result in self.pending for row in result]
        arrays = [taken.column(f.name) if f.name in taken.column_names
                  else pa.array([row[f.name] for row in rows], type=f.type) for f in self.rows_schema]
        table = pa.Table.from_arrays(arrays, schema=self.rows_schema)
        if self.score_metrics is not None:  # the verdicts of the rows as written, in their schema places
            verdicts = self.score_metrics(table)
            table = pa.Table.from_arrays([pa.array(verdicts[f.name], f.type) if f.name in verdicts
                                          else table.column(f.name) for f in self.schema], schema=self.schema)
        if self.writer is None:
            self.writer = pq.ParquetWriter(self.file.path, self.schema)
        self.writer.write_table(table)
        self.ids.update(table.column("id"))
        self.num_rows += table.num_rows
        fresh = None
        if any(self.pending_restored):
            fresh = pa.array(np.repeat(~np.array(self.pending_restored), counts))
        self.pending, self.num_pending_rows, self.num_pending_tokens = [], 0, 0
        self.pending_restored = []
        return table if fresh is None else table.filter(fresh)

    def _take_sources(self, num_rows: int) -> pa.Table:
        pieces = []
        while num_rows:
            batch = self.sources.popleft()
            if batch.num_rows > num_rows:
                self.sources.appendleft(batch.slice(num_rows))
                batch = batch.slice(0, num_rows)
            pieces.append(batch)
            num_rows -= batch.num_rows
        return pa.Table.from_batches(pieces, schema=self.sources_schema)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def abort(self) -> None:
        try:
            self.close()
        finally:
            self.file.abort()


class UnitWriter:
    """Collects finished requests per unit, streams them to the unit's part, commits it when complete.

    `schema`: every part's schema (id in the job's one id type, the generated columns, the kept
    columns); `source_columns`: the input's id column name, then the kept columns.
    """

    def __init__(self, storage: Storage, schema: pa.Schema, source_columns: list[str], n: int,
                 commit: CommitContext, on_rows: Callable[[pa.Table], None] = lambda table: None,
                 on_committed: Callable[[WorkUnit], None] = lambda unit: None, openai_lines=None,
                 is_scoring: bool = False, score_metrics: MetricScorer | None = None, num_labels: int | None = None,
                 checkpoints: CheckpointWriter | None = None):
        self.storage = storage
        self.schema = schema
        self.source_columns = source_columns
        self.n = n
        self.commit = commit
        self.on_rows = on_rows
        self.on_committed = on_committed
        self.openai_lines = openai_lines  # batch_output.OpenAILines: fills openai_line (openai_batch output)
        self.is_scoring = is_scoring  # task: loglikelihood: one score row per input row
        self.score_metrics = score_metrics  # the job's metrics: verdict columns from the rows (None: none)
        self.num_labels = num_labels  # task: reward: the reward model's labels (None: another task)
        self.parts: dict[int, UnitPart] = {}
        self.checkpoints = checkpoints  # output.checkpoint_seconds: finished rows made durable as they finish
        self.num_restored_rows = 0  # output rows taken from earlier runs' checkpoints

    def open_unit(self, unit: WorkUnit) -> None:
        self.parts[unit.index] = UnitPart(unit, self.storage.open_part(unit.output_name), self.schema,
                                          self.score_metrics, is_reward=self.num_labels is not None)

    def add_source(self, unit_index: int, batch: pa.RecordBatch) -> None:
        part = self.parts[unit_index]
        columns = [batch.column(name) for name in self.source_columns]
        part.sources.append(pa.RecordBatch.from_arrays(
            [c.cast(f.type) for c, f in zip(columns, part.sources_schema)], schema=part.sources_schema))

    def add_output(self, task: RowTask, out: RequestOutput | ScoreOutput) -> None:
        if isinstance(out, ScoreOutput):
            self._set(task, score_rows(out))
            return
        if self.num_labels is not None:  # a reward job's PoolingRequestOutput
            self._set(task, reward_rows(out, self.num_labels, task.sample_index))
            return
        rows = sample_rows(task, out)
        if self.openai_lines is not None:
            _set_line(rows, self.openai_lines.success(task, out))
        self._set(task, rows)

    def add_error(self, task: RowTask) -> None:
        if self.num_labels is not None:
            self._set(task, reward_error_row(task.error, task.num_prompt_tokens, task.sample_index))
            return
        if self.is_scoring:
            self._set(task, score_error_rows(task))
            return
        rows = error_rows(task, self.n)
        if self.openai_lines is not None:
            _set_line(rows, self.openai_lines.error(task))
        self._set(task, rows)

    @property
    def num_open_units(self) -> int:
        return len(self.parts)

    def abort(self) -> None:
        """Remove every unfinished part's temp file (a failed run leaves only whole parts)."""
        while self.parts:
            self.parts.popitem()[1].abort()

    def restore(self, unit_index: int, offset: int, rows: list[dict]) -> None:
        """A request's rows as an earlier run's checkpoint holds them (its unit's source columns added first)."""
        self.parts[unit_index].restored.add(offset)
        self.num_restored_rows += len(rows)
        self._set_rows(unit_index, offset, rows)

    def maybe_checkpoint(self) -> None:
        if self.checkpoints is not None:
            self.checkpoints.maybe_write()

    def _set(self, task: RowTask, rows: list[dict]) -> None:
        for row in rows:  # the lora_name column, where the schema has it
            row[LORA_FIELD.name] = task.lora_name
        if self.checkpoints is not None:
            self.checkpoints.add(self.parts[task.unit_index].unit, task.offset, rows)
        self._set_rows(task.unit_index, task.offset, rows)
        self.maybe_checkpoint()

    def _set_rows(self, unit_index: int, offset: int, rows: list[dict]) -> None:
        part = self.parts[unit_index]
        part.set_rows(offset, rows)
        if part.should_flush:
            self.on_rows(part.flush())
        if part.is_complete:
            self._commit(self.parts.pop(unit_index))

    def _commit(self, part: UnitPart) -> None:
        try:
            part.close()
            self.commit.commit_unit(self.storage, part.file, part.unit, part.num_rows, part.ids.hexdigest())
        except BaseException:
            part.abort()
            raise
        if self.checkpoints is not None:
            self.checkpoints.on_committed(part.unit)
        self.on_committed(part.unit)
