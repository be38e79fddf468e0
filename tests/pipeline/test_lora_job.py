"""A job over LoRA adapters: model.lora_modules {A, B} and input.lora_column (A, B and null rows mixed)
give peft's greedy outputs for each row's adapter, and every output row names its adapter; one adapter
without a column runs every row, merged into the weights at load; an OpenAI batch line's model picks its adapter; an unknown name is an
error row; a deleted part is redone with the same
rows on resume; the adapters enter the config hash;
impossible combinations and an unreadable adapter are refused naming the key."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from batchgen.pipeline.config import validate_job
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.job import run_job
from tests.conftest import TEST_ENGINE_KWARGS
from tests.engine.prompts import QUESTIONS
from tests.lora_adapters import peft_greedy
from tests.pipeline.conftest import engine_sections, read_output, write_parquet

MAX_TOKENS = 8
ADAPTERS = ["A", "B", None, "A", "B", None]
ENGINE = {**TEST_ENGINE_KWARGS, "max_loras": 2, "max_lora_rank": 16}


def lora_job(tmp_path, model_folder, modules: dict | None, input_path="in.parquet", engine=ENGINE, **input_keys):
    sections = engine_sections(engine, model=str(model_folder))
    if modules is not None:  # None: a job file without the key
        sections["model"]["lora_modules"] = {name: str(path) for name, path in modules.items()}
    raw = {"name": "lora-job", **sections, "input": {"path": input_path, "prompt_column": "prompt", **input_keys},
           "sampling": {"max_tokens": MAX_TOKENS}, "output": {"path": str(tmp_path / "out")}}
    return validate_job(raw, tmp_path)


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """Six questions with adapters A, B and the base in turn, and one row naming an adapter not in the job."""
    tmp = tmp_path_factory.mktemp("lora-job-input")
    table = pa.table({"id": list(range(len(ADAPTERS) + 1)), "prompt": QUESTIONS[:len(ADAPTERS) + 1],
                      "adapter": [*ADAPTERS, "Z"]})
    return write_parquet(tmp / "in.parquet", table)


@pytest.fixture(scope="module")
def expected(lora_adapters, lora_llm, hf_tokenizer):
    """peft's greedy tokens for every question under A, under B and under the base."""
    peft_model, _ = lora_adapters
    ids = [lora_llm.engine.encode([{"role": "user", "content": q}]) for q in QUESTIONS[:len(ADAPTERS)]]
    return {name: peft_greedy(peft_model, name, ids, MAX_TOKENS, lora_llm.engine.eos_token_ids,
                              hf_tokenizer.pad_token_id) for name in ("A", "B", None)}


def test_rows_of_two_adapters_and_the_base_in_one_job_equal_peft(tmp_path, rows, lora_adapters, lora_llm,
                                                                  smollm_hf_folder, expected):
    _, folders = lora_adapters
    job = lora_job(tmp_path, smollm_hf_folder, {"A": folders["A"], "B": folders["B"]}, str(rows),
                   lora_column="adapter", rows_per_unit=4)
    engine = lora_llm.with_engine_settings(max_loras=2).engine
    run_job(job, engine=engine, progress=False)
    out = read_output(tmp_path / "out").to_pylist()
    # resume: a deleted part is run again (same config hash, adapters included) with the same rows
    (tmp_path / "out" / "part-00001.parquet").unlink()
    again = run_job(job, engine=lora_llm.with_engine_settings(max_loras=2).engine, progress=False)
    assert (again.num_units_run, again.num_units_skipped) == (1, 1)
    def rows_of(table):
        return [(r["id"], r["lora_name"], r["completion_token_ids"], r["error"]) for r in table]
    assert rows_of(read_output(tmp_path / "out").to_pylist()) == rows_of(out)
    assert expected["A"] != expected[None] and expected["B"] != expected[None]  # the adapters change outputs
    assert [r["lora_name"] for r in out] == [*ADAPTERS, "Z"]
    for i, name in enumerate(ADAPTERS):
        assert out[i]["error"] is None
        assert out[i]["completion_token_ids"] == expected[name][i], f"row {i}, adapter {name}"
    assert "'Z'" in out[-1]["error"] and "model.lora_modules" in out[-1]["error"]
    assert engine.stats["lora"]["tokens_by_adapter"]["A"] > 0 and engine.stats["lora"]["tokens_by_adapter"]["B"] > 0


def test_one_adapter_without_a_column_runs_every_row_merged(tmp_path, rows, lora_adapters, smollm_hf_folder,
                                                            expected):
    """The job's only adapter (B: rsLoRA, k/o/gate/up) is merged into the weights at load (its own engine,
    no LoRA layer runs) and gives peft's outputs for every row."""
    _, folders = lora_adapters
    job = lora_job(tmp_path, smollm_hf_folder, {"B": folders["B"]}, str(rows))
    assert job.engine_config().merged_lora == str(folders["B"]) and not job.engine_config().enable_lora
    run_job(job, progress=False)
    out = read_output(tmp_path / "out").to_pylist()
    assert [r["lora_name"] for r in out] == ["B"] * (len(ADAPTERS) + 1)
    assert [r["completion_token_ids"] for r in out[:len(ADAPTERS)]] == expected["B"]
    assert all(r["error"] is None for r in out)


def test_a_batch_lines_model_picks_its_adapter(tmp_path, lora_adapters, lora_llm, smollm_hf_folder, expected):
    """OpenAI batch lines: `model` names an adapter of model.lora_modules (as the server's does); another
    name runs the base; each response names the adapter that ran."""
    _, folders = lora_adapters
    models = ["A", "B", "gpt-4o-mini"]
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": model, "messages": [{"role": "user", "content": QUESTIONS[i]}]}}
             for i, model in enumerate(models)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    sections = engine_sections(ENGINE, model=str(smollm_hf_folder))
    sections["model"]["lora_modules"] = {"A": str(folders["A"]), "B": str(folders["B"])}
    job = validate_job({"name": "lora-batch", **sections, "input": {"path": "in.jsonl"},
                        "sampling": {"max_tokens": MAX_TOKENS}, "output": {"path": str(tmp_path / "out")}}, tmp_path)
    run_job(job, engine=lora_llm.with_engine_settings(max_loras=2).engine, progress=False)
    out = read_output(tmp_path / "out").to_pylist()
    assert [r["lora_name"] for r in out] == ["A", "B", None]
    assert [r["completion_token_ids"] for r in out] == [expected["A"][0], expected["B"][1], expected[None][2]]
    responses = [json.loads(x) for x in (tmp_path / "out" / "output.jsonl").read_text().splitlines()]
    assert {x["custom_id"]: x["response"]["body"]["model"] for x in responses} == \
        {"r0": "A", "r1": "B", "r2": str(smollm_hf_folder)}


def test_the_adapters_enter_the_config_hash(tmp_path, smollm_hf_folder):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain = lora_job(tmp_path, smollm_hf_folder, None)
    one = lora_job(tmp_path, smollm_hf_folder, {"A": tmp_path / "a"})
    other_path = lora_job(tmp_path, smollm_hf_folder, {"A": tmp_path / "b"})
    two = lora_job(tmp_path, smollm_hf_folder, {"A": tmp_path / "a", "B": tmp_path / "b"}, lora_column="adapter")
    hashes = {job.config_hash() for job in (plain, one, other_path, two)}
    assert len(hashes) == 4
    # a job without adapters keeps the hash it had before the keys existed (its outputs still resume)
    assert lora_job(tmp_path, smollm_hf_folder, {}).config_hash() == plain.config_hash()
    assert one.engine_config().merged_lora == str(tmp_path / "a") and not one.engine_config().enable_lora
    assert two.engine_config().enable_lora and two.engine_config().merged_lora is None
    assert not plain.engine_config().enable_lora and plain.engine_config().merged_lora is None
    # a relative adapter folder is the job file's folder's
    assert lora_job(tmp_path, smollm_hf_folder, {"A": "a"}).model.lora_modules["A"] == str(tmp_path / "a")


@pytest.mark.parametrize("modules, input_keys, message", [
    ({}, {"lora_column": "adapter"}, "input.lora_column: needs model.lora_modules"),
    ({"A": "a", "B": "b"}, {}, "input.lora_column: must name the column of each row's adapter"),
])
def test_impossible_combinations_name_the_key(tmp_path, smollm_hf_folder, modules, input_keys, message):
    with pytest.raises(JobError, match=message):
        lora_job(tmp_path, smollm_hf_folder, modules, **input_keys)


def test_an_adapter_that_cannot_be_read_fails_the_job_at_start(tmp_path, rows, lora_llm, smollm_hf_folder):
    job = lora_job(tmp_path, smollm_hf_folder, {"A": tmp_path / "missing"}, str(rows), lora_column="adapter")
    with pytest.raises(JobError, match=r"model.lora_modules.A: .*'A'.*not a folder"):
        run_job(job, engine=lora_llm.with_engine_settings(max_loras=2).engine, progress=False)
    assert not list((tmp_path / "out").glob("part-*.parquet"))
    merged = lora_job(tmp_path, smollm_hf_folder, {"A": tmp_path / "missing"}, str(rows))  # merged at load
    with pytest.raises(JobError, match=r"model.lora_modules.A: .*missing.*not a folder"):
        run_job(merged, progress=False)
    assert not list((tmp_path / "out").glob("part-*.parquet"))
