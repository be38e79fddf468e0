"""Inputs written by a careless user or an attacker: a batch line holding a lone surrogate escape, Parquet
bytes that are no UTF-8, lines nested too deep, an engine that cannot start (nothing left in the folder)."""

from __future__ import annotations

import json

import pyarrow as pa
import yaml
from typer.testing import CliRunner

from batchgen.cli import main as cli
from batchgen.pipeline.job import run_job
from tests.pipeline.conftest import make_job, read_output, write_parquet
from tests.pipeline.test_openai_batch import line, read_jsonl, write_lines


def tiny_job(tmp_path, tiny_model, input_path: str, **sections) -> str:
    raw = {"name": "hostile", "model": {"path": str(tiny_model), "max_model_len": 256, "dtype": "float32"},
           "engine": {"device": "cpu", "kv_cache_memory": "64MiB"}, "input": {"path": input_path},
           "sampling": {"max_tokens": 2}, "output": {"path": str(tmp_path / "out")}}
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def invoke(*args: str):
    return CliRunner().invoke(cli.app, list(args))


def test_a_surrogate_line_among_20_valid_ones_is_that_lines_error_and_the_job_exits_0(tmp_path, tiny_model):
    lines = [line(f"ok-{i:02d}") for i in range(20)]
    # Valid JSON (a lone surrogate escape, as real files hold), but no UTF-8 text (json.dumps keeps
    # the escape).
    bad = json.dumps(line("bad-surrogate", messages=[{"role": "user", "content": "a\ud800b"}]))
    assert "\\ud800" in bad
    lines.insert(7, bad)
    job = tiny_job(tmp_path, tiny_model, write_lines(tmp_path / "requests.jsonl", lines))

    result = invoke("run", job, "--no-progress")
    assert result.exit_code == 0, result.output
    out = tmp_path / "out"
    ok, errors = read_jsonl(out / "output.jsonl"), read_jsonl(out / "errors.jsonl")
    assert sorted(x["custom_id"] for x in ok) == [f"ok-{i:02d}" for i in range(20)]
    assert [x["custom_id"] for x in errors] == ["bad-surrogate"]
    error = errors[0]["response"]["body"]["error"]
    assert error["param"] == "messages[0].content" and "surrogate" in error["message"]
    assert errors[0]["response"]["status_code"] == 400


def test_lines_nested_too_deep_are_errors_or_a_bad_file_never_a_crash(tmp_path, tiny_model):
    deep_stop = {"custom_id": "deep-stop", "method": "POST", "url": "/v1/completions",
                 "body": {"prompt": "x", "stop": json.loads("[" * 40 + "]" * 40)}}
    lines = [line("ok"), deep_stop]
    job = tiny_job(tmp_path, tiny_model, write_lines(tmp_path / "requests.jsonl", lines))
    result = invoke("run", job, "--no-progress")
    assert result.exit_code == 0, result.output
    errors = read_jsonl(tmp_path / "out" / "errors.jsonl")
    assert [x["custom_id"] for x in errors] == ["deep-stop"]
    assert "deeper than" in errors[0]["response"]["body"]["error"]["message"]

    # Thousands deep: the parser cannot read the line, so no custom_id: a bad file (exit 2) naming it.
    bomb = '{"custom_id": "bomb", "method": "POST", "url": "/v1/completions", "body": {"prompt": ' \
           + "[" * 100_000 + "]" * 100_000 + "}}"
    write_lines(tmp_path / "requests.jsonl", [line("ok"), bomb])
    result = invoke("validate", job)
    assert result.exit_code == 2 and "line 2 nests JSON too deep" in result.stderr, result.output


def test_a_custom_id_with_a_lone_surrogate_makes_a_bad_file(tmp_path, tiny_model):
    job = tiny_job(tmp_path, tiny_model, write_lines(tmp_path / "requests.jsonl",
                                                     [line("ok"), json.dumps(line("id-\udc80"))]))
    result = invoke("validate", job)
    assert result.exit_code == 2 and "line 2 has a custom_id that is not valid Unicode" in result.stderr


def test_parquet_text_that_is_not_utf8_is_that_rows_error(tmp_path, engine):
    # CESU-8 / WTF-8 bytes of a lone surrogate: what a surrogate escape becomes in a binary column.
    prompts = [b"Say hi.", b"a\xed\xa0\x80b", b"Say bye."]
    write_parquet(tmp_path / "in.parquet", {"id": [1, 2, 3], "prompt": pa.array(prompts, pa.binary())})
    job = make_job(tmp_path, str(tmp_path / "in.parquet"), sampling={"max_tokens": 2})
    run_job(job, engine=engine, progress=False)
    rows = read_output(tmp_path / "out").to_pylist()
    assert [r["finish_reason"] == "error" for r in rows] == [False, True, False]
    assert "not valid UTF-8" in rows[1]["error"]


def test_an_engine_that_cannot_start_leaves_nothing_in_the_output_folder(tmp_path, tiny_model):
    write_parquet(tmp_path / "in.parquet", {"id": [1], "prompt": ["hi"]})
    job = tiny_job(tmp_path, tiny_model, str(tmp_path / "in.parquet"), input={"prompt_column": "prompt"},
                   engine={"kv_cache_memory": "1KiB"})  # valid as a setting, too small for one sequence
    result = invoke("run", job, "--no-progress")
    assert result.exit_code == 2 and "cannot start the engine" in result.stderr, result.output
    assert not (tmp_path / "out").exists()

    # A folder that exists and holds nothing keeps holding nothing.
    (tmp_path / "out").mkdir()
    assert invoke("run", job, "--no-progress").exit_code == 2
    assert list((tmp_path / "out").iterdir()) == []
    # Fixed, the same folder runs (no "different job config" from the failed start).
    result = invoke("run", job, "--no-progress", "--set", "engine.kv_cache_memory=64MiB",
                    "--set", "model.max_model_len=128")
    assert result.exit_code == 0, result.output


def ref_chain(num_links: int) -> dict:
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["x"]}
            for i in range(num_links)}
    defs[f"d{num_links}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


POISON = {  # custom_id -> (the line, the field its error names); each crashed or failed the job before
    "ref-chain-1000": (line("ref-chain-1000", response_format={"type": "json_schema", "json_schema": {
        "name": "chain", "schema": ref_chain(1_000)}}), "response_format.json_schema.schema"),
    "ref-chain-5000": (line("ref-chain-5000", response_format={"type": "json_schema", "json_schema": {
        "name": "chain", "schema": ref_chain(5_000)}}), "response_format.json_schema.schema"),
    "regex-bomb": (line("regex-bomb", structured_outputs={"regex": "a{1000}{1000}"}), "structured_outputs.regex"),
    "choice-100000": (line("choice-100000", structured_outputs={"choice": [f"c{i}" for i in range(100_000)]}),
                      "structured_outputs.choice"),
}


def test_poison_constraints_are_their_lines_errors_and_the_others_are_unchanged(tmp_path, tiny_model):
    normal = [line(f"ok-{i:02d}", temperature=0.8, seed=i) for i in range(20)]
    (tmp_path / "clean").mkdir()
    clean_job = tiny_job(tmp_path / "clean", tiny_model, write_lines(tmp_path / "clean.jsonl", normal))
    assert invoke("run", clean_job, "--no-progress").exit_code == 0
    mixed = list(normal)
    for position, (raw, _) in zip((2, 9, 14, 20), POISON.values()):
        mixed.insert(position, raw)
    job = tiny_job(tmp_path, tiny_model, write_lines(tmp_path / "requests.jsonl", mixed))

    result = invoke("run", job, "--no-progress")
    assert result.exit_code == 0, result.output
    errors = {x["custom_id"]: x["response"]["body"]["error"] for x in read_jsonl(tmp_path / "out" / "errors.jsonl")}
    assert sorted(errors) == sorted(POISON)
    for custom_id, (_, param) in POISON.items():
        assert errors[custom_id]["param"] == param, errors[custom_id]
    choices = {x["custom_id"]: x["response"]["body"]["choices"] for x in read_jsonl(tmp_path / "out" / "output.jsonl")}
    clean = {x["custom_id"]: x["response"]["body"]["choices"]
             for x in read_jsonl(tmp_path / "clean" / "out" / "output.jsonl")}
    assert choices == clean  # the normal lines' outputs, token for token, as in a run without the poison
    rerun = invoke("run", job, "--no-progress")
    assert rerun.exit_code == 0 and "0 unit(s) run" in rerun.output, rerun.output


def test_validate_refuses_a_job_wide_schema_too_deep_instead_of_crashing(tmp_path, tiny_model):
    (tmp_path / "chain.json").write_text(json.dumps(ref_chain(1_000)))
    job = tiny_job(tmp_path, tiny_model, write_lines(tmp_path / "requests.jsonl", [line("ok")]))
    raw = yaml.safe_load(open(job))
    raw["input"] = {"path": write_parquet(tmp_path / "in.parquet", {"id": [1], "prompt": ["hi"]}).as_posix()}
    raw["sampling"]["structured"] = {"json_file": str(tmp_path / "chain.json")}
    open(job, "w").write(yaml.safe_dump(raw))
    result = invoke("validate", job)
    assert result.exit_code == 2 and "deep" in result.output, result.output
