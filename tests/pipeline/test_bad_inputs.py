"""Bad rows become error rows and the job completes; bad jobs stop before any generation, naming the culprit."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from batchgen.engine import SamplingParams
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.job import run_job
from tests.engine.helpers import run_requests
from tests.pipeline.conftest import make_job, read_output, write_parquet

OVERLONG = "Tell me about the history of tea. " * 40  # ~320 tokens: over max_model_len 256 with the template


def bad_rows_table() -> pa.Table:
    prompts = pa.array([b"Say hi.", None, b"", OVERLONG.encode(), b"Count to three.", b"caf\xc3 \xff"],
                       pa.binary()).view(pa.string())  # the last one is not valid UTF-8
    return pa.table({"id": pa.array([10, 11, 12, 13, 14, 15], pa.int32()), "prompt": prompts,
                     "temp": pa.array([None, None, None, None, -1.0, None], pa.float64())})


def test_bad_rows_become_error_rows_and_the_job_completes(tmp_path, engine):
    path = write_parquet(tmp_path / "in.parquet", bad_rows_table())
    job = make_job(tmp_path, str(path), sampling={"max_tokens": 3}, sampling_columns={"temperature": "temp"})
    result = run_job(job, engine=engine, progress=False)
    out = read_output(tmp_path / "out")
    rows = {r["id"]: r for r in out.to_pylist()}
    assert out.schema.field("id").type == pa.int32()  # the input's id type
    assert list(rows) == [10, 11, 12, 13, 14, 15]
    assert rows[10]["finish_reason"] in ("stop", "length") and rows[10]["error"] is None
    expected = {11: "prompt is null", 12: "prompt is empty", 13: "overlong prompt",
                14: "invalid per-row sampling value (temp=-1.0)", 15: "not valid UTF-8"}
    for row_id, message in expected.items():
        row = rows[row_id]
        assert row["finish_reason"] == "error" and message in row["error"], row
        assert row["completion"] is None and row["completion_tokens"] == 0 and row["ttft_s"] is None
    # Measured before it was refused: the whole templated prompt, over max_model_len 256.
    assert rows[13]["prompt_tokens"] == len(engine.encode([{"role": "user", "content": OVERLONG}])) > 256
    assert result.record.num_errors == 5 and result.record.num_requests == 6
    assert json.loads((tmp_path / "out" / "_SUCCESS").read_text())["num_rows"] == 6


def test_truncate_left_keeps_the_end_of_an_overlong_prompt(tmp_path, engine):
    path = write_parquet(tmp_path / "in.parquet", {"id": [1], "prompt": [OVERLONG]})
    job = make_job(tmp_path, str(path), input={"on_overlong": "truncate_left"}, sampling={"max_tokens": 2})
    run_job(job, engine=engine, progress=False)
    [row] = read_output(tmp_path / "out").to_pylist()
    assert row["error"] is None and row["prompt_tokens"] == 256 - 2  # max_model_len - max_tokens
    # The kept tokens are the last 254 of the templated prompt: the engine, given those, says the same.
    kept = engine.encode([{"role": "user", "content": OVERLONG}])[-(256 - 2):]
    [expected] = run_requests(engine, {"kept": (kept, SamplingParams(temperature=0, max_tokens=2))})["kept"].outputs
    assert row["completion_token_ids"] == expected.token_ids and row["completion_tokens"] == len(expected.token_ids)


class Tripwire:
    """Any use of this engine means generation was reached: a bad job must fail before that."""

    def __getattr__(self, name):
        raise AssertionError(f"the engine was used ({name}) although the job is bad")


def corrupt(tmp_path):
    path = tmp_path / "in.parquet"
    path.write_bytes(b"PAR1 this is not really parquet")
    return path


def truncated(tmp_path):
    good = write_parquet(tmp_path / "good.parquet", {"id": list(range(100)), "prompt": ["p"] * 100})
    path = tmp_path / "data" / "in.parquet"
    path.parent.mkdir()
    path.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    return path


BAD_JOBS = {
    "missing prompt column": (lambda t: write_parquet(t / "in.parquet", {"id": [1], "text": ["a"]}), {},
                              ["in.parquet", "'prompt'", "input.prompt_column", "is missing"]),
    "missing id column": (lambda t: write_parquet(t / "in.parquet", {"prompt": ["a"]}), {},
                          ["'id'", "input.id_column"]),
    "prompt column of numbers": (lambda t: write_parquet(t / "in.parquet", {"id": [1], "prompt": [5]}), {},
                                 ["'prompt'", "int64", "expected a string type"]),
    "messages column of strings": (lambda t: write_parquet(t / "in.parquet", {"id": [1], "messages": ["hi"]}),
                                   {"input": {"prompt_column": None, "messages_column": "messages"}},
                                   ["'messages'", "list of structs"]),
    "sampling column of strings": (lambda t: write_parquet(t / "in.parquet", {"id": [1], "prompt": ["a"],
                                                                              "temp": ["hot"]}),
                                   {"sampling_columns": {"temperature": "temp"}},
                                   ["'temp'", "sampling_columns.temperature", "numeric"]),
    "schema column of numbers": (lambda t: write_parquet(t / "in.parquet", {"id": [1], "prompt": ["a"], "s": [5]}),
                                 {"input": {"schema_column": "s"}},
                                 ["'s'", "input.schema_column", "a JSON schema per row"]),
    "continuations column of strings": (
        lambda t: write_parquet(t / "in.parquet", {"id": [1], "prompt": ["a"], "c": ["x"]}),
        {"task": "loglikelihood", "input": {"continuations_column": "c"}},
        ["'c'", "input.continuations_column", "a list of strings"]),
    "continuation column of numbers": (
        lambda t: write_parquet(t / "in.parquet", {"id": [1], "prompt": ["a"], "c": [5]}),
        {"task": "loglikelihood", "input": {"continuation_column": "c"}},
        ["'c'", "input.continuation_column", "a string type"]),
    "missing kept column": (lambda t: write_parquet(t / "in.parquet", {"id": [1], "prompt": ["a"]}),
                            {"output": {"keep_columns": ["label"]}}, ["'label'", "output.keep_columns"]),
    "corrupt file": (corrupt, {}, ["in.parquet", "unreadable or not a Parquet file"]),
    "truncated file": (truncated, {}, ["data/in.parquet", "unreadable"]),
    "missing input": (lambda t: t / "nowhere.parquet", {}, ["input.path", "nowhere.parquet", "does not exist"]),
    "empty folder": (lambda t: (t / "empty").mkdir() or t / "empty", {}, ["input.path", "no .parquet files"]),
    "missing model": (lambda t: write_parquet(t / "in.parquet", {"id": [1], "prompt": ["a"]}),
                      {"model": {"path": "/no/such/model.gguf"}}, ["model.path", "/no/such/model.gguf"]),
}


@pytest.mark.parametrize("case", list(BAD_JOBS))
def test_bad_jobs_fail_before_generation_naming_the_culprit(tmp_path, case):
    make_input, sections, expected = BAD_JOBS[case]
    path = make_input(tmp_path)
    job = make_job(tmp_path, str(path), **sections)
    with pytest.raises(JobError) as info:
        run_job(job, engine=Tripwire(), progress=False)
    for part in expected:
        assert part in str(info.value), (case, str(info.value))
    assert not list((tmp_path / "out").glob("part-*"))
