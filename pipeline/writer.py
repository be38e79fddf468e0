"""Buffer each unit's results until every row is in, then write its file atomically, rows in input order."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.engine import RequestOutput
from batchgen.pipeline.requests import RowTask
from batchgen.pipeline.schema import generated_fields, output_schema
from batchgen.pipeline.storage import Storage
from batchgen.pipeline.units import WorkUnit


def sample_rows(task: RowTask, out: RequestOutput) -> list[dict]:
    """One output row per sample, with the design's latency definitions (monotonic seconds)."""
    arrival = out.metrics.arrival_time
    rows = []
    for c in sorted(out.outputs, key=lambda c: c.index):
        num_tokens = len(c.token_ids)
        has_tokens = c.first_token_time is not None
        rows.append({
            "sample_index": c.index,
            "completion": c.text,
            "completion_token_ids": list(c.token_ids),
            "finish_reason": c.finish_reason,
            "prompt_tokens": len(out.prompt_token_ids),
            "cached_tokens": out.num_cached_tokens,
            "completion_tokens": num_tokens,
            "cumulative_logprob": c.cumulative_logprob,
            "token_logprobs": c.logprobs,
            "queue_s": None if c.first_scheduled_time is None else c.first_scheduled_time - arrival,
            "ttft_s": c.first_token_time - arrival if has_tokens else None,
            "tpot_s": (c.last_token_time - c.first_token_time) / (num_tokens - 1) if num_tokens >= 2 else None,
            "e2e_s": c.last_token_time - arrival if has_tokens else None,
            "error": None,
        })
    return rows


def error_rows(task: RowTask, n: int) -> list[dict]:
    """n rows for a request that never ran: finish_reason error, the message, nothing generated."""
    row = {f.name: None for f in generated_fields(True)}
    row.update(finish_reason="error", error=task.error, prompt_tokens=task.num_prompt_tokens,
               cached_tokens=0, completion_tokens=0)
    return [{**row, "sample_index": i} for i in range(n)]


class UnitBuffer:
    """One unit's input-side columns (id + kept) and, per input row, its output rows once they exist."""

    def __init__(self, unit: WorkUnit, source_columns: list[str]):
        self.unit = unit
        self.source_columns = source_columns  # the id column first, then the kept columns
        self.sources: list[pa.RecordBatch] = []  # the unit's id + keep columns, input order, input types
        self.results: list[list[dict] | None] = [None] * unit.num_rows
        self.num_done = 0

    @property
    def is_complete(self) -> bool:
        return self.num_done == self.unit.num_rows

    def add_source(self, batch: pa.RecordBatch) -> None:
        self.sources.append(batch.select(self.source_columns))

    def set_rows(self, offset: int, rows: list[dict]) -> None:
        assert self.results[offset] is None, f"row {offset} of unit {self.unit.index} finished twice"
        self.results[offset] = rows
        self.num_done += 1

    def to_table(self, schema: pa.Schema) -> pa.Table:
        source = pa.Table.from_batches(self.sources).rename_columns(["id", *self.source_columns[1:]])
        counts = np.array([len(r) for r in self.results])
        taken = source.take(pa.array(np.repeat(np.arange(len(counts)), counts)))
        rows = [row for result in self.results for row in result]
        arrays = []
        for field in schema:
            if field.name in taken.column_names:
                arrays.append(taken.column(field.name))
            else:
                arrays.append(pa.array([row[field.name] for row in rows], type=field.type))
        return pa.Table.from_arrays(arrays, schema=schema)


class UnitWriter:
    """Collects finished requests per unit and writes each unit's file the moment its last row is in."""

    def __init__(self, storage: Storage, n: int, keep_columns: list[str], id_column: str, with_logprobs: bool,
                 on_written: Callable[[WorkUnit, pa.Table], None] = lambda unit, table: None):
        self.storage = storage
        self.n = n
        self.keep_columns = keep_columns
        self.id_column = id_column
        self.with_logprobs = with_logprobs
        self.on_written = on_written
        self.buffers: dict[int, UnitBuffer] = {}

    def open_unit(self, unit: WorkUnit) -> None:
        self.buffers[unit.index] = UnitBuffer(unit, [self.id_column, *self.keep_columns])

    def add_source(self, unit_index: int, batch: pa.RecordBatch) -> None:
        self.buffers[unit_index].add_source(batch)

    def add_output(self, task: RowTask, out: RequestOutput) -> None:
        self._set(task, sample_rows(task, out))

    def add_error(self, task: RowTask) -> None:
        self._set(task, error_rows(task, self.n))

    @property
    def num_open_units(self) -> int:
        return len(self.buffers)

    def _set(self, task: RowTask, rows: list[dict]) -> None:
        buffer = self.buffers[task.unit_index]
        buffer.set_rows(task.offset, rows)
        if buffer.is_complete:
            self._flush(task.unit_index)

    def _flush(self, unit_index: int) -> None:
        buffer = self.buffers.pop(unit_index)
        schema = self.schema_for(buffer.unit)
        table = buffer.to_table(schema)
        self.storage.write_atomic(buffer.unit.output_name, lambda target: pq.write_table(table, target))
        self.on_written(buffer.unit, table)

    def schema_for(self, unit: WorkUnit) -> pa.Schema:
        # The id column is "id" in the output whatever its input name; all keep their input types.
        file_schema = unit.file.schema
        return output_schema(file_schema.field(self.id_column),
                             [file_schema.field(name) for name in self.keep_columns], self.with_logprobs)
