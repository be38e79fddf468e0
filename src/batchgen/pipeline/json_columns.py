"""`output.parse_json`: a JSON answer (an LLM judge's, constrained by sampling.structured's schema) parsed
into one column per top-level property of the schema, e.g. `score` and `reason`, that a select stage reads.

Column types follow the property's JSON type: integer -> int64, number -> float64, boolean -> bool,
string -> string; any other (object, array, a union) -> its JSON text. A completion that is not a JSON
object (cut at max_tokens, a failed row) or a value of the wrong type gives null there.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import pyarrow as pa

from batchgen.metrics import metric_column

METADATA_KEY = b"batchgen.json_field"
_TYPES = {"integer": pa.int64(), "number": pa.float64(), "boolean": pa.bool_(), "string": pa.string()}


def schema_fields(schema: dict) -> list[pa.Field]:
    """The columns of a JSON schema's top-level properties, marked as parsed (METADATA_KEY)."""
    fields = []
    for name, prop in (schema.get("properties") or {}).items():
        kind = prop.get("type") if isinstance(prop, dict) else None
        fields.append(pa.field(name, _TYPES.get(kind, pa.string()), metadata={METADATA_KEY: b"1"}))
    return fields


def job_json_fields(job) -> list[pa.Field]:
    """The parsed columns of a job with output.parse_json (its sampling.structured JSON schema); none without."""
    if not getattr(job.output, "parse_json", False):
        return []
    constraint = job.sampling.constraint()
    if constraint is None or not isinstance(constraint.json, dict):
        return []
    return schema_fields(constraint.json)


def check_json_columns(job, reserved_names: set[str]) -> str | None:
    """Why output.parse_json's columns cannot be written (a property named as one of `reserved_names`, the
    generated columns, or as a metric or kept column; a schema with no properties); None when they can."""
    if not getattr(job.output, "parse_json", False):
        return None
    names = [f.name for f in job_json_fields(job)]
    if not names:
        return "the sampling.structured schema has no top-level properties to parse into columns"
    taken = set(reserved_names) | {metric_column(m) for m in job.metrics} | {
        job.output.rename_columns.get(c, c) for c in job.output.keep_columns}
    clash = sorted(set(names) & taken)
    if clash:
        return (f"the schema's property {clash[0]!r} would be written twice (it is a generated, metric or kept "
                "column); name it otherwise")
    return None


def json_field_names(schema: pa.Schema) -> set[str]:
    """The parsed columns of an output schema."""
    return {f.name for f in schema if f.metadata and METADATA_KEY in f.metadata}


def parse_answers(fields: Sequence[pa.Field], completions: Sequence[str | None]) -> dict[str, list]:
    """{column: values}: each completion's JSON object read into the fields (null where it cannot be)."""
    columns: dict[str, list] = {f.name: [] for f in fields}
    for text in completions:
        try:
            answer = json.loads(text) if text is not None else None
        except (ValueError, RecursionError):
            answer = None
        for f in fields:
            value = answer.get(f.name) if isinstance(answer, dict) else None
            columns[f.name].append(_as_type(value, f.type))
    return columns


def _as_type(value, t: pa.DataType):
    if value is None:
        return None
    if pa.types.is_boolean(t):
        return value if isinstance(value, bool) else None
    if isinstance(value, bool):  # JSON true is not a number here
        return None
    if pa.types.is_integer(t):
        return value if isinstance(value, int) else int(value) if isinstance(value, float) and value.is_integer() else None
    if pa.types.is_floating(t):
        return float(value) if isinstance(value, (int, float)) else None
    return value if isinstance(value, str) and not isinstance(value, bool) else json.dumps(value)


def with_json_columns(job, scorer):
    """The writer's derived columns: the metrics' verdicts (`scorer`, or None) and, with output.parse_json,
    the parsed answer's columns (read from each row's completion)."""
    fields = job_json_fields(job)
    if not fields:
        return scorer

    def derive(table: pa.Table) -> dict[str, list]:
        derived = dict(scorer(table)) if scorer is not None else {}
        derived.update(parse_answers(fields, table.column("completion").to_pylist()))
        return derived
    return derive
