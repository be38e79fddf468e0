"""Tools and reasoning in a job: a tools column on 100 rows with `input.tool_choice: required` gives every
row a schema-valid `tool_calls` value (OpenAI's list as JSON text, checked with jsonschema) and
finish_reason tool_calls where a sample ended by itself; a row whose tools are not JSON is that row's
error naming the column; `model.reasoning_parser` with `sampling.thinking_token_budget: 16` writes a
`reasoning` column of at most 16 tokens beside an answer; bad tool settings fail validation by key."""

from __future__ import annotations

import json

import pytest

from batchgen.pipeline.config import JobConfig, validate_job
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.job import run_job
from tests.conftest import TEST_ENGINE_KWARGS
from tests.engine.prompts import QUESTIONS
from tests.engine.text.tool_template import HERMES_TEMPLATE, QUESTION, TIME, TOOLS, WEATHER, check_calls
from tests.pipeline.conftest import engine_sections, read_output, write_parquet

NUM_ROWS = 100
KWARGS = {**TEST_ENGINE_KWARGS, "max_model_len": 1024, "kv_cache_memory": "128MiB"}


def job_config(folder, kwargs: dict, input_extra: dict, sampling: dict) -> JobConfig:
    raw = {"name": "tools", **engine_sections(kwargs),
           "input": {"path": str(folder / "in.parquet"), "messages_column": "messages",
                     "chat_template": HERMES_TEMPLATE, **input_extra},
           "sampling": sampling, "output": {"path": str(folder / "out")}}
    return validate_job(raw, folder)


@pytest.fixture(scope="module")
def tools_job(tmp_path_factory, llm):
    """100 rows: alternately both tools and the weather tool alone (a tools column), every tenth a null cell
    (the job's input.tools: the time tool), the last one not JSON."""
    folder = tmp_path_factory.mktemp("tools-job")
    tools = [None if i % 10 == 5 else json.dumps(TOOLS if i % 2 else [WEATHER]) for i in range(NUM_ROWS - 1)]
    tools.append("[{not json")
    write_parquet(folder / "in.parquet", {"id": list(range(NUM_ROWS)), "messages": [QUESTION] * NUM_ROWS,
                                          "tools": tools})
    kwargs = {**KWARGS, "tool_call_parser": "hermes"}
    job = job_config(folder, kwargs, {"tools_column": "tools", "tools": [TIME], "tool_choice": "required",
                                             "parallel_tool_calls": False},
                     {"max_tokens": 64, "temperature": 0.8, "seed": 1})
    engine = llm.with_engine_settings(**{k: v for k, v in kwargs.items() if k not in ("dtype", "device")}).engine
    run_job(job, engine=engine, progress=False)
    return {r["id"]: r for r in read_output(folder / "out").to_pylist()}, tools


@pytest.mark.slow
def test_every_row_of_a_required_tools_job_has_schema_valid_tool_calls(tools_job):
    rows, tools = tools_job
    assert len(rows) == NUM_ROWS
    for row_id in range(NUM_ROWS - 1):
        row = rows[row_id]
        assert row["error"] is None, row
        names = {t["function"]["name"] for t in json.loads(tools[row_id])} if tools[row_id] else {"get_time"}
        check_calls(json.loads(row["tool_calls"]), names)
        assert row["finish_reason"] == "tool_calls" and len(json.loads(row["tool_calls"])) == 1, row
        assert "<tool_call>" not in row["completion"]
    bad = rows[NUM_ROWS - 1]
    assert bad["finish_reason"] == "error" and "column 'tools'" in bad["error"] and "not JSON" in bad["error"]


def test_a_thinking_budget_of_16_bounds_every_rows_reasoning(tmp_path, llm):
    write_parquet(tmp_path / "in.parquet", {"id": list(range(8)),
                                            "messages": [[{"role": "user", "content": q}] for q in QUESTIONS[:8]]})
    kwargs = {**KWARGS, "reasoning_parser": "qwen3"}
    job = job_config(tmp_path, kwargs, {"chat_template_kwargs": {"enable_thinking": True}},
                     {"max_tokens": 40, "min_tokens": 30, "temperature": 0.8, "seed": 2, "thinking_token_budget": 16})
    engine = llm.with_engine_settings(**{k: v for k, v in kwargs.items() if k not in ("dtype", "device")}).engine
    run_job(job, engine=engine, progress=False)
    rows = read_output(tmp_path / "out").to_pylist()
    assert len(rows) == 8
    end_ids = engine.tokenizer.encode("</think>", add_special_tokens=False)
    for row in rows:
        assert row["error"] is None and row["reasoning"] and "</think>" not in row["reasoning"]
        assert 0 < row["reasoning_tokens"] <= 16
        ids = row["completion_token_ids"]
        assert ids[row["reasoning_tokens"]:row["reasoning_tokens"] + len(end_ids)] == end_ids  # where it ended
        assert row["completion"].strip() and "</think>" not in row["completion"]  # an answer part


@pytest.mark.parametrize("input_extra, model_extra, key", [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, {}, "input.tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": TIME["function"]["name"]}}}, {},
     "input.tool_choice"),
    ({"tool_choice": "required"}, {}, "input.tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "auto"}, {}, "input.tool_choice"),
    ({"tools": [WEATHER]}, {"tool_call_parser": "json"}, "model.tool_call_parser"),
    ({}, {"reasoning_parser": "r1"}, "model.reasoning_parser"),
    ({"sampling": {"thinking_token_budget": 16}}, {}, "sampling.thinking_token_budget"),
])
def test_bad_tool_settings_fail_validation_naming_the_key(tmp_path, input_extra, model_extra, key):
    sampling = input_extra.get("sampling", {})
    raw = {"name": "bad", **engine_sections({**KWARGS, **model_extra}),
           "input": {"path": "in.parquet", "messages_column": "messages",
                     **{k: v for k, v in input_extra.items() if k != "sampling"}},
           "sampling": sampling, "output": {"path": "out"}}
    with pytest.raises(JobError) as caught:
        validate_job(raw, tmp_path)
    assert key in str(caught.value), str(caught.value)


def test_a_batch_file_line_with_a_named_tool_gets_its_call_in_output_jsonl(tmp_path, llm):
    """OpenAI batch lines carry their own tools: a forced call lands in the line's message.tool_calls; a
    line asking for a thinking budget without the job's reasoning parser is that line's error."""
    lines = [{"custom_id": "call", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": "x", "messages": QUESTION, "tools": TOOLS, "max_tokens": 64, "tool_choice": {
            "type": "function", "function": {"name": "get_time"}}}},
        {"custom_id": "budget", "method": "POST", "url": "/v1/chat/completions", "body": {
            "model": "x", "messages": QUESTION, "thinking_token_budget": 8}}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    kwargs = {**KWARGS, "tool_call_parser": "hermes"}
    raw = {"name": "batch-tools", **engine_sections(kwargs), "input": {
        "path": str(tmp_path / "in.jsonl"), "chat_template": HERMES_TEMPLATE}, "output": {"path": str(tmp_path / "out")}}
    engine = llm.with_engine_settings(**{k: v for k, v in kwargs.items() if k not in ("dtype", "device")}).engine
    run_job(validate_job(raw, tmp_path), engine=engine, progress=False)
    (ok,) = [json.loads(x) for x in (tmp_path / "out" / "output.jsonl").read_text().splitlines()]
    (error,) = [json.loads(x) for x in (tmp_path / "out" / "errors.jsonl").read_text().splitlines()]
    choice = ok["response"]["body"]["choices"][0]
    assert ok["custom_id"] == "call" and choice["finish_reason"] == "tool_calls"
    check_calls(choice["message"]["tool_calls"], {"get_time"})
    assert error["custom_id"] == "budget"
    assert error["response"]["body"]["error"]["param"] == "thinking_token_budget"
    rows = {r["id"]: r for r in read_output(tmp_path / "out").to_pylist()}
    check_calls(json.loads(rows["call"]["tool_calls"]), {"get_time"})
