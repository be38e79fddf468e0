"""A job's input, checked as a whole: its files' footers and schemas, one type per copied column, its fingerprint."""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from batchgen.metrics import metric_field
from batchgen.pipeline.batch_file import BATCH_SUFFIX, inspect_batch_files
from batchgen.pipeline.column_types import unify_column_types
from batchgen.pipeline.config import JobConfig
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.input_file import InputFile
from batchgen.pipeline.json_columns import check_json_columns, job_json_fields
from batchgen.pipeline.lora_job import uses_lora
from batchgen.pipeline.output import FileFingerprint, fingerprint_files
from batchgen.pipeline.reader import inspect_file, list_input_files
from batchgen.pipeline.reward_job import reward_type
from batchgen.pipeline.schema import RESERVED_NAMES, check_input_schema, output_schema
from batchgen.pipeline.storage import Storage
from batchgen.pipeline.tool_rows import job_has_tools


@dataclass(frozen=True)
class JobInputs:
    storage: Storage
    files: list[InputFile]  # sorted: units are numbered along this list
    fingerprint: list[FileFingerprint]
    column_types: dict[str, pa.DataType]  # the id column and the kept columns, one type across files

    def output_schema(self, job: JobConfig) -> pa.Schema:
        """Every part's schema: id (the input's one id type), the generated columns, the metrics' verdict
        columns, the kept columns."""
        renamed = job.output.rename_columns
        keep = [pa.field(renamed.get(name, name), self.column_types[name]) for name in job.output.keep_columns]
        # A batch file's lines each ask for logprobs or not: both columns are there, null where not asked.
        logprobs = 1 if job.input.is_batch_file else job.sampling.logprobs
        return output_schema(pa.field("id", self.column_types[job.input.id_column]), keep, logprobs,
                             with_openai_line=job.writes_batch_output, is_scoring=job.is_scoring,
                             metric_fields=[metric_field(name, spec) for name, spec in job.metrics.items()]
                             + job_json_fields(job),
                             with_reasoning=job.model.reasoning_parser is not None,
                             with_tool_calls=job_has_tools(job),
                             reward_type=reward_type(job.num_labels) if job.is_reward else None,
                             with_lora=uses_lora(job))


def read_inputs(job: JobConfig) -> JobInputs:
    """List and check every input file (JobError naming the file, column or key at fault)."""
    if (problem := check_json_columns(job, RESERVED_NAMES)) is not None:
        raise JobError(f"output.parse_json: {problem}")
    storage = Storage(job.input.path, job.input.storage_options)
    if job.input.is_batch_file:  # each line checked here; the schema is the batch file's own
        files = inspect_batch_files(storage, list_input_files(storage, BATCH_SUFFIX))
    else:
        files = [inspect_file(storage, p) for p in list_input_files(storage)]
        for file in files:
            check_input_schema(file, job)
    copied = {job.input.id_column: "input.id_column",
              **{name: "output.keep_columns" for name in job.output.keep_columns}}
    return JobInputs(storage, files, fingerprint_files(storage, files), unify_column_types(files, copied))
