"""engine.speculative in a job: same rows as speculation off, num_accepted_tokens filled (null when
off), `_SUCCESS` with the draft and accepted counts; a draft with another vocabulary is a bad job."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file, save_file

from batchgen.engine.config import SettingError
from batchgen.pipeline.job import run_job
from tests.pipeline.conftest import PIPELINE_ENGINE_KWARGS, make_job, read_output, write_parquet
from tests.pipeline.tiny_model import write_tiny_model

PROMPTS = ["List the numbers 1, 2, 3, 4, 5, 6, 7, 8.", "Repeat after me: the quick brown fox."]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


def test_a_speculative_job_writes_the_same_rows_and_its_figures(tmp_path, engine, llm):
    path = write_parquet(tmp_path / "in.parquet", {"id": [1, 2], "prompt": PROMPTS})
    off_job = make_job(tmp_path / "off", str(path), sampling={"max_tokens": 24})
    run_job(off_job, engine=engine, progress=False)
    on_job = make_job(tmp_path / "on", str(path), sampling={"max_tokens": 24}, engine={"speculative": NGRAM})
    assert on_job.config_hash() == off_job.config_hash()  # it changes no output
    spec_engine = llm.with_engine_settings(max_model_len=PIPELINE_ENGINE_KWARGS["max_model_len"],
                                           speculative=NGRAM).engine
    run_job(on_job, engine=spec_engine, progress=False)

    off, on = read_output(tmp_path / "off" / "out"), read_output(tmp_path / "on" / "out")
    assert on.column("completion_token_ids").to_pylist() == off.column("completion_token_ids").to_pylist()
    assert off.column("num_accepted_tokens").to_pylist() == [None, None]
    accepted = on.column("num_accepted_tokens").to_pylist()
    assert all(isinstance(a, int) for a in accepted)
    off_success = json.loads((tmp_path / "off" / "out" / "_SUCCESS").read_text())
    success = json.loads((tmp_path / "on" / "out" / "_SUCCESS").read_text())
    assert off_success["speculative"] is None
    spec = success["speculative"]
    assert spec["num_accepted_tokens"] == sum(accepted) and spec["num_draft_tokens"] > 0
    assert spec["acceptance_rate"] == pytest.approx(sum(accepted) / spec["num_draft_tokens"])
    assert spec["mean_accepted_length"] >= 1.0


def test_a_draft_with_another_vocabulary_is_a_bad_job(tmp_path, llm):
    folder = write_tiny_model(tmp_path / "draft", llm.engine.tokenizer.hf)
    weights = load_file(str(folder / "model.safetensors"))
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"][:1000].clone()
    save_file(weights, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": 1000}))
    with pytest.raises(SettingError, match="vocabulary"):
        llm.with_engine_settings(speculative={"method": "draft_model", "model": str(folder)})
    # A ValueError from the engine's start is a bad job (JobError: the CLI exits 2), as for any setting.
    assert issubclass(SettingError, ValueError)
