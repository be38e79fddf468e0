"""A replica with a null engine: it reads its unit's ids, writes a part of empty completions column-wise and
commits it with its record. For measuring the Ray driver (1M rows in seconds, not the engine's minutes)."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.pipeline.output import CommitContext, IdChecksum
from batchgen.pipeline.reader import read_rows
from batchgen.pipeline.run_record import EngineReport
from batchgen.pipeline.storage import Storage
from batchgen.pipeline.summary import Totals

_VALUES = {"sample_index": 0, "finish_reason": "length", "prompt_tokens": 1, "cached_tokens": 0,
           "completion_tokens": 0, "completion": "", "completion_token_ids": []}


class NullReplica:
    def __init__(self, job, output_schema: pa.Schema, commit: CommitContext):
        self.job = job
        self.schema = output_schema
        self.commit = commit
        self.input_storage = Storage(job.input.path, job.input.storage_options)
        self.output_storage = Storage(job.output.path, job.output.storage_options)

    def ready(self) -> dict:
        return {"host": "null", "pid": os.getpid(), "engine": EngineReport()}  # no engine: nothing to report

    def run_unit(self, unit, repeats) -> dict:
        part = self.output_storage.open_part(unit.output_name)
        ids = IdChecksum()
        num_rows = 0
        with pq.ParquetWriter(part.path, self.schema) as writer:
            for batch in read_rows(self.input_storage, unit.file, unit.start, unit.stop, [self.job.input.id_column]):
                n = batch.num_rows
                arrays = [batch.column(0).cast(self.schema.field("id").type) if f.name == "id"
                          else pa.array([_VALUES[f.name]] * n, f.type) if f.name in _VALUES
                          else pa.nulls(n, f.type) for f in self.schema]
                writer.write_table(pa.Table.from_arrays(arrays, schema=self.schema))
                ids.update(batch.column(0))
                num_rows += n
        self.commit.commit_unit(self.output_storage, part, unit, num_rows, ids.hexdigest())
        return {"unit": unit.index, "totals": Totals(num_requests=num_rows, num_rows=num_rows,
                                                     prompt_tokens=num_rows),
                "generation_seconds": 0.0, "pid": os.getpid()}
