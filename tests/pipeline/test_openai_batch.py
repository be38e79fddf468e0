"""OpenAI batch files without a model: line -> settings, error rows, bad files (exit 2), the .jsonl outputs."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import yaml
from openai.types import Completion
from openai.types.chat import ChatCompletion
from typer.testing import CliRunner

from batchgen.cli import main as cli
from batchgen.engine import SamplingParams
from batchgen.pipeline.batch_lines import decode_line
from batchgen.pipeline.config import JobConfig, validate_job
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.job import run_job
from tests.pipeline.conftest import (
    FailingEngine,
    FakeEngine,
    engine_sections,
    make_job,
    read_output,
    write_parquet,
)

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def line(custom_id: str, url: str = CHAT, **body) -> dict:
    if "messages" not in body and "prompt" not in body:
        body = {**({"messages": [{"role": "user", "content": f"hi {custom_id}"}]} if url == CHAT
                   else {"prompt": f"text {custom_id}"}), **body}
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def write_lines(path, lines: list) -> str:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


def batch_job(tmp_path, input_path: str, **sections):
    raw = {"name": "batch", **engine_sections(), "input": {"path": input_path},
           "sampling": {"max_tokens": 4}, "output": {"path": str(tmp_path / "out")}}
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    return validate_job(raw, tmp_path)


def read_jsonl(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


# ---- a line's body -> the request's settings -----------------------------------------------------

def test_a_chat_body_sets_every_sampling_field_and_the_job_fills_the_rest(tmp_path):
    job = batch_job(tmp_path, "x.jsonl", sampling={"max_tokens": 9, "top_k": 5})
    raw = line("a", model="gpt-4o", temperature=0.7, top_p=0.9, n=3, seed=11, stop="END", presence_penalty=0.5,
               frequency_penalty=-0.5, min_p=0.1, repetition_penalty=1.2, min_tokens=1, ignore_eos=True,
               stop_token_ids=[5], max_completion_tokens=6, max_tokens=99, logprobs=True, top_logprobs=3)
    row = decode_line("a", json.dumps(raw).encode(), job)
    assert row.error is None
    assert row.prompt == [{"role": "user", "content": "hi a"}]
    assert row.params == SamplingParams(n=3, temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, repetition_penalty=1.2,
                                        presence_penalty=0.5, frequency_penalty=-0.5, max_tokens=6, min_tokens=1,
                                        seed=11, stop=["END"], stop_token_ids=[5], ignore_eos=True, logprobs=3)
    assert row.sample_key == ""  # seeded: (seed, sample index), as the server draws
    assert row.openai.endpoint == "chat"

    plain = decode_line("b", json.dumps(line("b")).encode(), job)
    assert plain.params == job.sampling_params()  # nothing set: the job's sampling section
    assert plain.sample_key is None  # keyed by custom_id with the job's seed


def test_a_completions_body_takes_a_string_or_token_ids_and_logprobs_as_a_number(tmp_path):
    job = batch_job(tmp_path, "x.jsonl")
    row = decode_line("c", json.dumps(line("c", COMPLETIONS, prompt=[5, 6, 7], logprobs=2, max_tokens=3)).encode(), job)
    assert row.error is None and row.prompt == [5, 6, 7] and row.openai.endpoint == "completions"
    assert (row.params.logprobs, row.params.max_tokens) == (2, 3)
    text = decode_line("d", json.dumps(line("d", COMPLETIONS, prompt=["one"])).encode(), job)
    assert text.prompt == "one" and text.params.logprobs is None


@pytest.mark.parametrize("raw, param, words", [
    (line("x", tools=[{"type": "function", "function": {"description": "no name"}}]), "tools[0].function.name",
     "is required"),
    (line("x", tools=[{"type": "function", "function": {"name": "f"}}], tool_choice={
        "type": "function", "function": {"name": "g"}}), "tool_choice.function.name", "not among the tools"),
    (line("x", response_format={"type": "json_schema", "json_schema": {"name": "p"}}),
     "response_format.json_schema.schema", "is required"),
    (line("x", response_format={"type": "json_object"}, guided_regex="a"), "guided_regex", "one output constraint"),
    (line("x", logit_bias={"5": 1}), "logit_bias", "not supported"),
    (line("x", temperature=-1), "temperature", "must be in"),
    (line("x", temperature="hot"), "temperature", "valid number"),
    (line("x", n=2), "n", "greedy"),  # the job's temperature 0 with n 2
    (line("x", top_logprobs=2), "top_logprobs", "needs logprobs"),
    (line("x", max_completion_tokens=0), "max_completion_tokens", ">= 1"),
    (line("x", frobnicate=1), "frobnicate", "unknown field"),
    (line("x", stream=True), "stream", "not supported"),
    (line("x", messages=[]), "messages", ""),
    (line("x", COMPLETIONS, prompt=["a", "b"]), "prompt", "one prompt"),
    (line("x", "/v1/embeddings", input="x"), "url", "/v1/embeddings"),
    ({**line("x"), "method": "GET"}, "method", "POST"),
    ({**line("x"), "body": "text"}, "body", "JSON object"),
    ({**line("x"), "extra": 1}, "extra", "unknown key"),
    (line("x", COMPLETIONS, prompt="a", prompt_logprobs=0), "prompt_logprobs", "not supported"),  # 0 asks
    (line("x", guided_json="[" * 5000), "guided_json", "nests too deep"),  # a schema as JSON text
])
def test_what_is_wrong_inside_a_line_is_its_error_naming_the_field(tmp_path, raw, param, words):
    row = decode_line("x", json.dumps(raw).encode(), batch_job(tmp_path, "x.jsonl"))
    assert row.error is not None and words in row.error
    assert row.openai.error_param == param


def test_a_server_field_at_its_do_nothing_value_is_accepted(tmp_path):
    raw = line("x", COMPLETIONS, prompt="a", echo=False, length_penalty=1.0, use_beam_search=False)
    assert decode_line("x", json.dumps(raw).encode(), batch_job(tmp_path, "x.jsonl")).error is None


# ---- bad files: exit 2 before anything runs, naming the lines ------------------------------------

@pytest.mark.parametrize("lines, expected", [
    ([line("a"), "{not json", line("b")], ["line 2 is not valid JSON"]),
    ([line("a"), {"method": "POST", "url": CHAT, "body": {}}], ["line 2 has no custom_id"]),
    ([line("a"), {**line("b"), "custom_id": 7}], ["line 2 has a custom_id that is not a non-empty string"]),
    ([line("a"), line("b"), line("a"), line("b")],
     ["line 3 repeats custom_id 'a' of line 1", "line 4 repeats custom_id 'b' of line 2"]),
    (["[1, 2]", line("a"), "", "oops", line("a")],  # a blank line is skipped, and counted
     ["line 1 is not a JSON object", "line 4 is not valid JSON", "line 5 repeats custom_id 'a' of line 2"]),
])
def test_a_bad_batch_file_is_a_bad_job_naming_every_bad_line(tmp_path, lines, expected, monkeypatch):
    from batchgen.engine.runner import executor

    monkeypatch.setattr(executor, "load_model", lambda *a, **k: pytest.fail("weights were loaded"))
    write_lines(tmp_path / "in.jsonl", lines)
    raw = {"name": "bad", **engine_sections(), "input": {"path": "in.jsonl"}, "sampling": {"max_tokens": 4}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(raw))
    result = CliRunner().invoke(cli.app, ["run", str(tmp_path / "job.yaml"), "--no-progress"])
    assert result.exit_code == 2, result.output
    assert "in.jsonl is not a valid OpenAI batch file" in result.output
    for text in expected:
        assert text in result.output
    assert not (tmp_path / "out").exists()  # nothing was written


def test_a_custom_id_is_unique_across_the_files_of_a_job(tmp_path):
    (tmp_path / "data").mkdir()
    write_lines(tmp_path / "data" / "a.jsonl", [line("x"), line("y")])
    write_lines(tmp_path / "data" / "b.jsonl", [line("z"), line("y")])
    job = batch_job(tmp_path, str(tmp_path / "data"), input={"format": "openai_batch"})
    with pytest.raises(JobError, match=r"b.jsonl is not a valid.*\n  line 2 repeats custom_id 'y' of line 2 of .*a.jsonl"):
        run_job(job, engine=FakeEngine(job.engine_config()), progress=False)


# ---- a job: output.jsonl, errors.jsonl, resume ----------------------------------------------------

def mixed_lines(num: int) -> list[dict]:
    lines = [line(f"r{i}", COMPLETIONS if i % 3 else CHAT, **({"temperature": 0.8, "n": 2} if i % 4 == 1 else {}))
             for i in range(num)]
    lines[2] = line("r2", logit_bias={"5": 1})
    lines[5] = line("r5", COMPLETIONS, temperature=7000)
    return lines


def check_outputs(out, num: int) -> tuple[list[dict], list[dict]]:
    ok, errors = read_jsonl(out / "output.jsonl"), read_jsonl(out / "errors.jsonl")
    ids = Counter(x["custom_id"] for x in ok + errors)
    assert ids == Counter({f"r{i}": 1 for i in range(num)})
    for x in ok:
        body = x["response"]["body"]
        assert x["response"]["status_code"] == 200 and x["error"] is None
        parsed = (ChatCompletion if body["object"] == "chat.completion" else Completion).model_validate(body)
        i = int(x["custom_id"][1:])
        assert parsed.object == ("chat.completion" if i % 3 == 0 else "text_completion")
        assert len(parsed.choices) == (2 if i % 4 == 1 else 1)
        assert parsed.usage.total_tokens == parsed.usage.prompt_tokens + parsed.usage.completion_tokens
    assert {x["custom_id"]: x["response"]["body"]["error"]["param"] for x in errors} == {
        "r2": "logit_bias", "r5": "temperature"}
    assert all(x["response"]["status_code"] == 400 for x in errors)
    return ok, errors


def test_a_batch_job_writes_output_and_errors_jsonl_from_its_parts(tmp_path):
    job = batch_job(tmp_path, write_lines(tmp_path / "in.jsonl", mixed_lines(12)), input={"rows_per_unit": 5})
    assert job.writes_batch_output  # auto: the input's format
    engine = FakeEngine(job.engine_config())
    result = run_job(job, engine=engine, progress=False)
    out = tmp_path / "out"
    ok, errors = check_outputs(out, 12)
    assert [x["custom_id"] for x in ok] == [f"r{i}" for i in range(12) if i not in (2, 5)]  # input order
    assert result.record.num_requests == 12 and result.record.num_errors == 2
    rows = read_output(out)
    assert rows.num_rows == 12 + 2  # r1 and r9 ask for n 2 (r5's line was replaced by a failing one)
    assert rows.column("id").to_pylist()[:3] == ["r0", "r1", "r1"]
    assert engine.sample_keys["r0"] is None
    manifest = json.loads((out / "_batchgen.json").read_text())
    assert manifest["input"]["files"][0]["num_rows"] == 12  # the batch file has a fingerprint


def test_a_failed_batch_job_resumes_and_every_custom_id_is_written_once(tmp_path):
    job = batch_job(tmp_path, write_lines(tmp_path / "in.jsonl", mixed_lines(12)), input={"rows_per_unit": 2},
                    engine={"max_num_seqs": 2})
    with pytest.raises(RuntimeError, match="preempted"):
        run_job(job, engine=FailingEngine(job.engine_config(), fail_step=3), progress=False)
    out = tmp_path / "out"
    assert not (out / "_SUCCESS").exists() and not (out / "output.jsonl").exists()
    result = run_job(job, engine=FakeEngine(job.engine_config()), progress=False)
    assert result.num_units_skipped >= 1 and result.record.resumed is True
    check_outputs(out, 12)


def test_a_batch_file_on_an_object_store_writes_its_outputs_there(tmp_path):
    import fsspec

    fs = fsspec.filesystem("memory")
    with fs.open("/batch-test/in.jsonl", "wb") as f:
        f.write(b"".join(json.dumps(x).encode() + b"\n" for x in mixed_lines(6)))
    job = batch_job(tmp_path, "memory://batch-test/in.jsonl", output={"path": "memory://batch-test/out"})
    run_job(job, engine=FakeEngine(job.engine_config()), progress=False)
    ok = [json.loads(x) for x in fs.cat("/batch-test/out/output.jsonl").decode().splitlines()]
    errors = [json.loads(x) for x in fs.cat("/batch-test/out/errors.jsonl").decode().splitlines()]
    assert sorted(x["custom_id"] for x in ok + errors) == [f"r{i}" for i in range(6)]
    assert fs.exists("/batch-test/out/_SUCCESS")
    fs.rm("/batch-test", recursive=True)


def test_a_resume_over_a_changed_batch_file_is_refused(tmp_path):
    path = tmp_path / "in.jsonl"
    job = batch_job(tmp_path, write_lines(path, mixed_lines(6)), input={"rows_per_unit": 2}, engine={"max_num_seqs": 2})
    with pytest.raises(RuntimeError, match="preempted"):
        run_job(job, engine=FailingEngine(job.engine_config(), fail_step=1), progress=False)
    assert list((tmp_path / "out").glob("part-*.parquet"))  # some units were done
    with path.open("a") as f:
        f.write(json.dumps(line("late")) + "\n")
    with pytest.raises(JobError, match=r"the input changed .*in.jsonl grew from 6 to 7 rows"):
        run_job(job, engine=FakeEngine(job.engine_config()), progress=False)


def test_parquet_prompts_can_be_written_as_openai_batch_output(tmp_path):
    path = write_parquet(tmp_path / "in.parquet", {"id": [1, 2], "prompt": ["a", ""]})
    job = make_job(tmp_path, str(path), output={"format": "openai_batch"})
    run_job(job, engine=FakeEngine(job.engine_config()), progress=False)
    (ok,), (error,) = read_jsonl(tmp_path / "out" / "output.jsonl"), read_jsonl(tmp_path / "out" / "errors.jsonl")
    assert ok["custom_id"] == "1" and ChatCompletion.model_validate(ok["response"]["body"])
    assert error["custom_id"] == "2" and "prompt is empty" in error["response"]["body"]["error"]["message"]


def test_the_example_batch_job_runs(tmp_path):
    from pathlib import Path

    from batchgen.pipeline.config import load_job

    job_file = Path(__file__).resolve().parents[2] / "jobs" / "openai_batch.yaml"
    sections = engine_sections()
    overrides = [f"{s}.{k}={v}" for s in ("model", "engine") for k, v in sections[s].items()]
    job = load_job(job_file, [*overrides, f"output.path={tmp_path / 'out'}"])
    run_job(job, engine=FakeEngine(job.engine_config()), progress=False)
    ok, errors = read_jsonl(tmp_path / "out" / "output.jsonl"), read_jsonl(tmp_path / "out" / "errors.jsonl")
    assert len(ok) == 8 and errors == []  # the tool-call line runs (its call forced)


# ---- the job file --------------------------------------------------------------------------------

def test_formats_follow_the_extension_and_only_batch_formats_change_the_config_hash(tmp_path):
    parquet = make_job(tmp_path, "in.parquet")
    assert (parquet.input.format, parquet.output.format) == ("parquet", "parquet")
    assert make_job(tmp_path, "in.parquet", input={"format": "parquet"}).config_hash() == parquet.config_hash()
    as_batch = make_job(tmp_path, "in.parquet", output={"format": "openai_batch"})
    assert as_batch.config_hash() != parquet.config_hash()  # its parts carry openai_line
    batch = batch_job(tmp_path, "data/*.jsonl")
    assert (batch.input.format, batch.output.format, batch.input.id_column) == ("openai_batch",) * 2 + ("custom_id",)
    assert JobConfig.model_validate(batch.model_dump()) == batch  # a dumped job validates again
    assert batch_job(tmp_path, "x.jsonl", output={"format": "parquet"}).config_hash() != \
        batch_job(tmp_path, "x.jsonl").config_hash()


@pytest.mark.parametrize("sections, words", [
    ({"input": {"prompt_column": "prompt"}}, "takes no prompt_column"),
    ({"input": {"messages_column": "m", "system_prompt": "s"}}, "takes no messages_column, system_prompt"),
    ({"input": {"id_column": "id", "apply_chat_template": False}}, "takes no id_column, apply_chat_template"),
    ({"input": {"allow_duplicate_ids": True}}, "allow_duplicate_ids must be false"),
    ({"sampling_columns": {"temperature": "t"}}, "sampling_columns: does not apply"),
])
def test_keys_that_mean_nothing_for_a_batch_file_are_refused(tmp_path, sections, words):
    with pytest.raises(JobError, match=words):
        batch_job(tmp_path, "x.jsonl", **sections)
