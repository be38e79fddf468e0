"""Structured output in a job: `sampling.structured` (a schema file relative to the job file) for every
row, `input.schema_column` for a schema per row (a row's unusable schema is that row's error, the
others run), `_SUCCESS.structured`; a bad job-wide constraint fails the job before any row (and
`batchgen validate` finds it without loading weights); the config hash covers a schema file's
content, not its path."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml
from typer.testing import CliRunner

from batchgen.bench.structured_quality import KEYWORDS, PERSON, SCHEMAS, VERDICT
from batchgen.cli import main as cli
from batchgen.pipeline.config import load_job
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.job import run_job
from tests.pipeline.conftest import engine_sections, read_output, write_parquet

QUESTIONS = ["Tell me about a friend of yours.", "What is the capital of France?", "Recommend a book.",
             "Describe your ideal weekend.", "What is photosynthesis?", "Give me a fun fact."]
UNSATISFIABLE = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}},
                 "required": ["a"]}


def write_job(folder: Path, sampling: dict, input_extra: dict | None = None, name: str = "job") -> Path:
    job = {"name": name, **engine_sections(),
           "input": {"path": "in.parquet", "messages_column": "messages", **(input_extra or {})},
           "sampling": {"max_tokens": 96, **sampling}, "output": {"path": "out"}}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))  # a schema keeps its properties' order
    return path


def messages(instruction: str, question: str) -> list[dict]:
    return [{"role": "system", "content": instruction}, {"role": "user", "content": question}]


@pytest.fixture(scope="module")
def schema_job(tmp_path_factory, engine):
    """6 rows: 2 on the job's schema file (null schema cells), 2 with their own schema, one whose schema
    cannot be satisfied, one whose schema is not JSON."""
    folder = tmp_path_factory.mktemp("structured")
    (folder / "schemas").mkdir()
    (folder / "schemas" / "person.json").write_text(json.dumps(PERSON))
    cells = [None, None, json.dumps(KEYWORDS), json.dumps(VERDICT), json.dumps(UNSATISFIABLE), "{not json"]
    instructions = [SCHEMAS["person"][0]] * 2 + [SCHEMAS["keywords"][0], SCHEMAS["verdict"][0]] + ["Answer."] * 2
    write_parquet(folder / "in.parquet", {
        "id": list(range(6)),
        "messages": [messages(i, q) for i, q in zip(instructions, QUESTIONS)],
        "schema": cells})
    path = write_job(folder, {"structured": {"json_file": "schemas/person.json"}}, {"schema_column": "schema"})
    result = run_job(load_job(path), engine=engine, progress=False)
    return folder, result, cells


def test_rows_follow_the_job_schema_or_their_own_and_a_bad_schema_is_that_rows_error(schema_job):
    folder, _, _ = schema_job
    rows = {r["id"]: r for r in read_output(folder / "out").to_pylist()}
    expected = {0: PERSON, 1: PERSON, 2: KEYWORDS, 3: VERDICT}
    for row_id, schema in expected.items():
        row = rows[row_id]
        assert row["error"] is None and row["finish_reason"] == "stop", row
        jsonschema.validate(json.loads(row["completion"]), schema)
    assert rows[4]["finish_reason"] == "error" and "column 'schema'" in rows[4]["error"] \
        and "unsatisfiable" in rows[4]["error"].lower()
    assert rows[5]["finish_reason"] == "error" and "column 'schema'" in rows[5]["error"] \
        and "not valid JSON" in rows[5]["error"]


def test_success_reports_the_constrained_requests_and_the_mask_time(schema_job):
    folder, result, _ = schema_job
    structured = result.record.structured
    assert structured.num_constrained_requests == 4 and result.record.num_errors == 2
    assert structured.num_masked_steps > 0 and structured.mask_ms_per_step > 0
    assert 1 <= structured.masked_rows_per_step <= 4
    assert json.loads((folder / "out" / "_SUCCESS").read_text())["structured"] == structured.to_dict()


def test_a_job_constraint_the_library_refuses_fails_the_job_before_any_row(tmp_path, engine):
    write_parquet(tmp_path / "in.parquet", {"id": [0], "messages": [messages("Answer.", "Hi")]})
    path = write_job(tmp_path, {"structured": {"json": UNSATISFIABLE}})
    with pytest.raises(JobError, match=r"sampling\.structured\.json: .*nsatisfiable"):
        run_job(load_job(path), engine=engine, progress=False)
    assert not (tmp_path / "out" / "_SUCCESS").exists() and not list((tmp_path / "out").glob("part-*"))
    path = write_job(tmp_path, {"structured": {"regex": "[a-z"}}, name="regex")
    result = CliRunner().invoke(cli.app, ["validate", str(path)])  # the tokenizer alone: no weights
    assert result.exit_code == 2 and "sampling.structured.regex" in result.output and "unclosed" in result.output


def test_job_file_errors_name_the_structured_key(tmp_path):
    write_parquet(tmp_path / "in.parquet", {"id": [0], "messages": [messages("Answer.", "Hi")]})
    cases = [({"structured": {"jsn": {}}}, r"sampling\.structured: jsn: unknown key"),
             ({"structured": {"json_file": "missing.json"}}, r"sampling\.structured\.json_file: cannot read .*missing\.json"),
             ({"structured": {"json_file": "s.json", "regex": "a"}}, r"set json_file or regex, not both"),
             ({"structured": {"choice": []}}, r"sampling\.structured\.choice: must hold at least one string"),
             ({"structured": {"choice": ["a"]}, "ignore_eos": True}, r"sampling\.ignore_eos: must be false with"),
             ({"structured": {"regex": "a", "choice": ["a"]}}, r"sampling\.structured: exactly one of")]
    for i, (sampling, message) in enumerate(cases):
        path = write_job(tmp_path, sampling, name=f"bad{i}")
        with pytest.raises(JobError, match=message):
            load_job(path)
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(JobError, match=r"json_file: .*list\.json must hold a JSON schema object"):
        load_job(write_job(tmp_path, {"structured": {"json_file": "list.json"}}, name="list"))


def test_the_config_hash_covers_the_schema_files_content_not_its_path(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        write_parquet(tmp_path / name / "in.parquet", {"id": [0], "messages": [messages("Answer.", "Hi")]})
        (tmp_path / name / "schema.json").write_text(json.dumps(PERSON))
    job_a = load_job(write_job(tmp_path / "a", {"structured": {"json_file": "schema.json"}}))
    job_b = load_job(write_job(tmp_path / "b", {"structured": {"json_file": "schema.json"}}))
    inline = load_job(write_job(tmp_path / "a", {"structured": {"json": PERSON}}, name="inline"))
    assert job_a.sampling.constraint().json == PERSON == inline.sampling.constraint().json
    # the input path differs (it is hashed), so compare the sampling part of two jobs on one input
    (tmp_path / "a" / "other.json").write_text(json.dumps(KEYWORDS))
    other = load_job(write_job(tmp_path / "a", {"structured": {"json_file": "other.json"}}, name="other"))
    moved = load_job(write_job(tmp_path / "a", {"structured": {"json_file": str(tmp_path / "b" / "schema.json")}},
                               name="moved"))
    plain = load_job(write_job(tmp_path / "a", {}, name="plain"))
    assert moved.config_hash() == job_a.config_hash() != other.config_hash()
    assert plain.config_hash() != job_a.config_hash() and job_b.config_hash() != job_a.config_hash()
    assert plain.sampling_params().structured_outputs is None
    # The properties' order shapes the grammar (the order the keys are generated in): hashed too.
    reordered = {**PERSON, "properties": dict(reversed(list(PERSON["properties"].items())))}
    assert reordered == PERSON
    swapped = load_job(write_job(tmp_path / "a", {"structured": {"json": reordered}}, name="swapped"))
    assert swapped.config_hash() != inline.config_hash()
