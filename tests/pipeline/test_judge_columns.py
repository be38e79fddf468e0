"""The judge's pieces without a model: JSON answers parsed into typed columns (output.parse_json) and
prompts rendered from a row's columns in Jinja's sandbox (input.prompt_template)."""

from __future__ import annotations

import pyarrow as pa
import pytest
import yaml

from batchgen.pipeline.config import load_job
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.job_plan import plan_job
from batchgen.pipeline.json_columns import parse_answers, schema_fields
from batchgen.pipeline.prompt_template import render_prompt, template_columns
from tests.pipeline.conftest import write_parquet

SCHEMA = {"type": "object", "properties": {"score": {"type": "integer"}, "confidence": {"type": "number"},
                                           "is_correct": {"type": "boolean"}, "reason": {"type": "string"},
                                           "tags": {"type": "array", "items": {"type": "string"}}}}


def test_each_property_becomes_a_column_of_its_json_type():
    fields = {f.name: f.type for f in schema_fields(SCHEMA)}
    assert fields == {"score": pa.int64(), "confidence": pa.float64(), "is_correct": pa.bool_(),
                      "reason": pa.string(), "tags": pa.string()}


def test_answers_parse_into_typed_values_and_anything_else_into_nulls():
    answers = ['{"score": 4, "confidence": 1, "is_correct": true, "reason": "ok", "tags": ["a"]}',
               '{"score": 3.0, "confidence": "high", "is_correct": 1, "reason": 7}',
               '{"score": true}', '{"score": 2', "[1, 2]", None]
    columns = parse_answers(schema_fields(SCHEMA), answers)
    assert columns["score"] == [4, 3, None, None, None, None]  # true is no integer; a cut answer gives nulls
    assert columns["confidence"] == [1.0, None, None, None, None, None]
    assert columns["is_correct"] == [True, None, None, None, None, None]
    assert columns["reason"] == ["ok", "7", None, None, None, None]
    assert columns["tags"] == ['["a"]', None, None, None, None, None]
    for name, values in columns.items():  # every column converts to its declared arrow type
        pa.array(values, type=dict((f.name, f.type) for f in schema_fields(SCHEMA))[name])


def test_a_template_reads_its_free_variables_and_renders_a_rows_columns():
    text = "{% for m in messages %}{{ m.content }}{% endfor %} -> {{ completion | upper }}"
    assert template_columns(text) == ["completion", "messages"]
    assert render_prompt(text, {"messages": [{"role": "user", "content": "q"}], "completion": "a"}) == "q -> A"


def test_a_template_that_cannot_render_a_row_says_why():
    with pytest.raises(ValueError, match="'completion' is undefined"):
        render_prompt("{{ completion }}", {})
    with pytest.raises(ValueError, match="refused by the sandbox|cannot render"):  # no way out of the sandbox
        render_prompt("{{ completion.__class__.__mro__ }}", {"completion": "a"})
    with pytest.raises(ValueError, match="is not a valid Jinja template"):
        template_columns("{{ completion")


def _job(tmp_path, **output) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({
        "name": "judge", "model": {"path": "smollm2-135m-instruct"},
        "input": {"path": str(tmp_path / "in.parquet"), "prompt_template": "{{ completion }}"},
        "output": {"path": str(tmp_path / "out"), "parse_json": True, **output},
        "sampling": {"max_tokens": 8, "structured": {"json": SCHEMA}}}))
    return str(path)


def test_clashing_parsed_columns_and_two_prompt_sources_are_refused_naming_the_key(tmp_path):
    write_parquet(tmp_path / "in.parquet", {"id": [1], "completion": ["a"], "reason": ["b"]})
    assert plan_job(load_job(_job(tmp_path))).units  # refused when its inputs are read, before any model loads
    with pytest.raises(JobError, match=r"output.parse_json: the schema's property 'reason' would be written twice"):
        plan_job(load_job(_job(tmp_path, keep_columns=["reason"])))
    with pytest.raises(JobError, match=r"input: set prompt_template, prompt_column or messages_column: one prompt source"):
        path = _job(tmp_path)
        load_job(path, ["input.messages_column=messages"])


def test_a_row_the_template_cannot_fill_is_that_rows_error_alone(tmp_path):
    """A failed earlier sample (null completion) has nothing to judge: its row errors, the others render."""
    from batchgen.pipeline.parquet_rows import decode_batch
    from tests.pipeline.conftest import make_job

    table = pa.table({"id": [1, 2, 3], "completion": ["a", None, "c"],
                      "messages": [[{"role": "user", "content": f"q{i}"}] for i in range(3)]})
    job = make_job(tmp_path, str(write_parquet(tmp_path / "in.parquet", table)),
                   input={"path": str(tmp_path / "in.parquet"), "prompt_column": None,
                          "prompt_template": "Q: {{ messages[0].content }} A: {{ completion }}"})
    rows = decode_batch(table.to_batches()[0], job)
    assert [r.prompt for r in (rows[0], rows[2])] == [[{"role": "user", "content": "Q: q0 A: a"}],
                                                      [{"role": "user", "content": "Q: q2 A: c"}]]
    assert rows[1].prompt is None and "column completion is null in this row" in rows[1].error
