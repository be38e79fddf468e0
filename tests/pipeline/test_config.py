"""Job file contract: defaults, errors naming the key path and allowed values, --set, paths, config hash."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from batchgen.pipeline.config import load_job
from batchgen.pipeline.errors import JobError

BASE = {"name": "t", "model": {"path": "smollm2-135m-instruct"}, "input": {"path": "data/in.parquet"}}


def write_job(folder: Path, raw: dict, name: str = "job.yaml") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(yaml.safe_dump(raw))
    return path


def with_keys(**sections) -> dict:
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in BASE.items()}
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
    return raw


def error_of(tmp_path: Path, raw: dict, overrides: tuple[str, ...] = ()) -> str:
    with pytest.raises(JobError) as info:
        load_job(write_job(tmp_path, raw), overrides)
    return str(info.value)


def test_defaults_follow_the_design_contract(tmp_path):
    job = load_job(write_job(tmp_path, BASE))
    m = job.model
    assert (m.dtype, m.quantization, m.fp8_mode, m.quantize_lm_head, m.max_model_len) == \
        ("auto", "auto", "auto", False, 4096)
    e = job.engine
    assert (e.device, e.attention_backend, e.block_size, e.max_num_seqs, e.max_num_batched_tokens,
            e.enable_prefix_caching, e.kv_cache_memory) == ("auto", "auto", 16, 128, 4096, True, "auto")
    i = job.input
    assert (i.id_column, i.prompt_column, i.messages_column, i.apply_chat_template, i.system_prompt,
            i.on_overlong, i.rows_per_unit) == ("id", "prompt", None, True, None, "error", 10000)
    s = job.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty, s.presence_penalty,
            s.frequency_penalty, s.max_tokens, s.min_tokens, s.n, s.seed, s.stop, s.stop_token_ids,
            s.ignore_eos, s.logprobs) == (0.0, 1.0, -1, 0.0, 1.0, 0.0, 0.0, 256, 0, 1, 0, [], [], False, False)
    assert (job.batching.sort_by_length, job.batching.window) == (True, 8192)
    assert job.output.keep_columns == [] and job.sampling_columns == {}


def test_relative_paths_are_relative_to_the_job_files_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the job's folder
    job_file = write_job(tmp_path / "jobs", with_keys(model={"path": "models/m.gguf"}))
    job = load_job(job_file)
    folder = (tmp_path / "jobs").resolve()
    assert job.input.path == str(folder / "data/in.parquet")
    assert job.model.path == str(folder / "models/m.gguf")
    assert job.output.path == str(folder / "out/t")  # default: out/<name> beside the job file
    uri = load_job(write_job(tmp_path, with_keys(input={"path": "s3://b/x/*.parquet"}, output={"path": "/abs/o"})))
    assert uri.input.path == "s3://b/x/*.parquet" and uri.output.path == "/abs/o"
    assert uri.model.path == "smollm2-135m-instruct"  # an alias stays an alias


@pytest.mark.parametrize("section, key, bad, expected", [
    ("input", "on_overlong", "drop", ["input.on_overlong", "'error' or 'truncate_left'", "'drop'"]),
    ("model", "dtype", "fp64", ["model.dtype: must be one of auto, float32, bfloat16, float16 (got 'fp64')"]),
    ("engine", "device", "tpu", ["engine.device", "auto, cpu, cuda, cuda:N", "(got 'tpu')"]),
    ("engine", "attention_backend", "flash",
     ["engine.attention_backend: must be one of auto, cpu, sdpa, triton, torch (got 'flash')"]),
    ("engine", "kv_cache_dtype", "int8",
     ["engine.kv_cache_dtype: must be one of auto, fp8, fp8_e4m3, fp8_e5m2 (got 'int8')"]),
    ("engine", "kv_cache_memory", "lots", ["engine.kv_cache_memory", "8GiB"]),
    ("engine", "max_num_seqs", 0, ["engine.max_num_seqs: must be >= 1 (got 0)"]),
    ("sampling", "top_p", 2, ["sampling.top_p: must be in (0, 1] (got 2.0)"]),
    ("model", "quantize_lm_head", "maybe", ["model.quantize_lm_head", "valid boolean"]),
    ("model", "int_calibration", "gptq",
     ["model.int_calibration: must be one of activation_aware, none (got 'gptq')"]),
    ("sampling", "temprature", 0.5, ["sampling.temprature", "unknown key", "temperature, top_p"]),
    ("batching", "window", 0, ["batching.window", "greater than or equal to 1"]),
])
def test_invalid_settings_name_the_key_path_and_allowed_values(tmp_path, section, key, bad, expected):
    message = error_of(tmp_path, with_keys(**{section: {key: bad}}))
    assert "job.yaml" in message
    for part in expected:
        assert part in message


def test_cross_key_rules_are_errors(tmp_path):
    assert "sampling.n: must be 1 with greedy sampling" in error_of(tmp_path, with_keys(sampling={"n": 4}))
    assert "sampling.max_tokens: must be below model.max_model_len (4096) (got 4096)" in \
        error_of(tmp_path, with_keys(sampling={"max_tokens": 4096}))
    assert "sampling.min_tokens: must be in [0, max_tokens] (got 9)" in \
        error_of(tmp_path, with_keys(sampling={"max_tokens": 8, "min_tokens": 9}))
    message = error_of(tmp_path, with_keys(sampling_columns={"n": "n_col"}))
    assert "sampling_columns" in message and "temperature" in message  # lists what may be overridden
    assert "not both" in error_of(tmp_path, with_keys(input={"prompt_column": "p", "messages_column": "m"}))
    assert "input: " in error_of(tmp_path, with_keys(input={"messages_column": "m", "apply_chat_template": False}))
    assert "model.path: required" in error_of(tmp_path, {"name": "t", "input": {"path": "x"}, "model": {}})


def test_set_overrides_are_typed_as_yaml(tmp_path):
    job_file = write_job(tmp_path, BASE)
    job = load_job(job_file, ["sampling.temperature=0.7", "sampling.n=3", "sampling.stop=[END, '###']",
                              "engine.enable_prefix_caching=false", "input.system_prompt=Be brief.",
                              "sampling_columns.max_tokens=budget", "name=renamed"])
    assert job.sampling.temperature == 0.7 and isinstance(job.sampling.temperature, float)
    assert job.sampling.n == 3 and job.sampling.stop == ["END", "###"]
    assert job.engine.enable_prefix_caching is False
    assert job.input.system_prompt == "Be brief."
    assert job.sampling_columns == {"max_tokens": "budget"} and job.name == "renamed"
    assert load_job(job_file, ["input.system_prompt=null"]).input.system_prompt is None


def test_set_errors_name_the_key(tmp_path):
    job_file = write_job(tmp_path, BASE)
    with pytest.raises(JobError, match="section.key=value"):
        load_job(job_file, ["sampling.temperature"])
    with pytest.raises(JobError, match=r"sampling\.temperatur: unknown key"):
        load_job(job_file, ["sampling.temperatur=1"])
    with pytest.raises(JobError, match=r"sampling\.max_tokens: Input should be a valid integer"):
        load_job(job_file, ["sampling.max_tokens=lots"])


def test_set_paths_are_relative_to_the_current_directory(tmp_path, monkeypatch):
    job_file = write_job(tmp_path / "jobs", BASE)
    monkeypatch.chdir(tmp_path)
    job = load_job(job_file, ["output.path=elsewhere/out", "input.path=memory://bucket/in.parquet"])
    assert job.output.path == os.path.join(str(tmp_path), "elsewhere/out")
    assert job.input.path == "memory://bucket/in.parquet"


def test_config_hash_covers_what_changes_outputs_only(tmp_path):
    job_file = write_job(tmp_path, BASE)
    base = load_job(job_file).config_hash()
    same = ["engine.max_num_seqs=4", "engine.kv_cache_memory=1GiB", "output.path=/elsewhere",
            "batching.window=16", "input.storage_options={anon: true}", "output.keep_columns=[a]", "name=other",
            "engine.kv_cache_dtype=auto", "engine.calculate_kv_scales=false", "engine.attention_backend=cpu"]
    for item in same:
        assert load_job(job_file, [item]).config_hash() == base, item
    different = ["sampling.temperature=0.5", "sampling.seed=1", "input.rows_per_unit=5", "model.max_model_len=2048",
                 "input.system_prompt=hi", "sampling_columns.temperature=t", "model.dtype=float32",
                 "engine.kv_cache_dtype=fp8", "engine.calculate_kv_scales=true", "model.int_calibration=none"]
    for item in different:
        assert load_job(job_file, [item]).config_hash() != base, item
    fp8_kv = {load_job(job_file, [f"engine.kv_cache_dtype={name}"]).config_hash() for name in ("fp8", "fp8_e5m2")}
    assert len(fp8_kv) == 2


def test_job_file_problems_are_job_errors(tmp_path):
    with pytest.raises(JobError, match="not found"):
        load_job(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("name: [unclosed\n")
    with pytest.raises(JobError, match="not valid YAML"):
        load_job(tmp_path / "bad.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(JobError, match="mapping"):
        load_job(tmp_path / "list.yaml")
