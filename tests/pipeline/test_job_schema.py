"""The job schema is EngineConfig's and SamplingParams' fields: same names, same defaults (except the
documented job defaults), same checks; the generated job-file reference names the same keys."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import yaml
from pydantic import BaseModel, create_model
from typer.testing import CliRunner

from batchgen.cli import main as cli
from batchgen.engine import EngineConfig, SamplingParams
from batchgen.engine.config import check_settings
from batchgen.pipeline.config import (
    EngineSection,
    ModelSection,
    SamplingSection,
    derive_section,
    load_job,
    sampling_keys,
    validate_job,
)
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.job import run_job
from batchgen.pipeline.job_settings import (
    ENGINE_ONLY,
    JOB_DEFAULTS,
    MODEL_JOB_KEYS,
    MODEL_KEYS,
    MODEL_PATH_FIELD,
    ROW_OVERRIDABLE,
    SAMPLING_ONLY,
    SAMPLING_RENAMED,
)
from tests.pipeline.conftest import make_job, read_output, write_parquet
from tests.pipeline.tiny_model import tiny_config, write_tiny_model

DOCS = Path(__file__).resolve().parents[2] / "docs"


def field_names(owner: type) -> set[str]:
    return {f.name for f in dataclasses.fields(owner)}


# SamplingParams fields set by a job key of another name (sampling.structured: structured_outputs).
RENAMED_FIELDS = {field: key for key, (field, _) in SAMPLING_RENAMED.items()}


def not_learned(owner: type, sections: list[type[BaseModel]], not_job_keys: dict) -> set[str]:
    """Fields of `owner` neither job keys in `sections` (by their name, or renamed) nor listed (with a
    reason) as not job keys."""
    keys = {k for section in sections for k in section.model_fields} - {"path"}
    keys |= {field for field, key in RENAMED_FIELDS.items() if key in keys}
    return field_names(owner) - keys - set(not_job_keys) - {MODEL_PATH_FIELD if owner is EngineConfig else ""}


def engine_default(owner: type, key: str) -> Any:
    if owner is SamplingParams and key in SAMPLING_RENAMED:
        key = SAMPLING_RENAMED[key][0]
    f = {f.name: f for f in dataclasses.fields(owner)}[key]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


SECTIONS = [("model", ModelSection, EngineConfig), ("engine", EngineSection, EngineConfig),
            ("sampling", SamplingSection, SamplingParams)]


def test_every_engine_and_sampling_field_is_a_job_key_or_listed_with_a_reason():
    assert not_learned(SamplingParams, [SamplingSection], SAMPLING_ONLY) == set()
    assert not_learned(EngineConfig, [ModelSection, EngineSection], ENGINE_ONLY) == set()
    # ... and nothing else: no job key the engine does not know, no key in two sections.
    assert set(SamplingSection.model_fields) == \
        (field_names(SamplingParams) - set(SAMPLING_ONLY) - set(RENAMED_FIELDS)) | set(SAMPLING_RENAMED)
    assert set(ModelSection.model_fields) == {*MODEL_JOB_KEYS, *MODEL_KEYS}
    assert not set(ModelSection.model_fields) & set(EngineSection.model_fields)
    assert set(EngineSection.model_fields) | set(MODEL_KEYS) | set(ENGINE_ONLY) | {MODEL_PATH_FIELD} == \
        field_names(EngineConfig)
    for listed in (ENGINE_ONLY, SAMPLING_ONLY, {k: reason for k, (_, reason) in SAMPLING_RENAMED.items()}):
        for name, reason in listed.items():
            assert len(reason) > 20, name  # a reason, not a placeholder
    assert set(ENGINE_ONLY) <= field_names(EngineConfig) and set(SAMPLING_ONLY) <= field_names(SamplingParams)
    assert set(ROW_OVERRIDABLE) <= set(SamplingSection.model_fields)


def test_a_field_added_to_sampling_params_is_caught_or_learned():
    @dataclasses.dataclass
    class WithBestOf(SamplingParams):
        best_of: int = 1

        def __post_init__(self) -> None:
            super().__post_init__()
            check_settings(self, [("best_of", self.best_of >= self.n, "must be >= n")])

    # A hand-copied schema (today's keys, frozen) would not learn it, and the check above names it.
    hand_copied = create_model("HandCopied", **{k: (Any, None) for k in SamplingSection.model_fields})
    assert not_learned(WithBestOf, [hand_copied], SAMPLING_ONLY) == {"best_of"}
    # The derived schema learns it, with its default, and keeps the job's own defaults.
    derived = derive_section("Derived", WithBestOf, "sampling", sampling_keys(WithBestOf),
                             base=SamplingSection.__bases__[0])  # with the renamed keys (structured)
    assert not_learned(WithBestOf, [derived], SAMPLING_ONLY) == set()
    section = derived(best_of=3, temperature=0.5, n=2)
    assert section.best_of == 3 and derived().best_of == 1 and derived().temperature == 0.0
    with pytest.raises(ValueError, match=r"WithBestOf.best_of must be >= n"):
        WithBestOf(**derived(n=4, temperature=1.0).model_dump(exclude=set(SAMPLING_RENAMED)))


@pytest.mark.parametrize("section, model, owner", SECTIONS)
def test_job_defaults_are_the_engines_except_the_documented_table(section, model, owner):
    for key, field in model.model_fields.items():
        if key in MODEL_JOB_KEYS:
            continue
        job = field.get_default(call_default_factory=True)
        if (section, key) in JOB_DEFAULTS:
            documented, reason = JOB_DEFAULTS[section, key]
            assert job == documented and job != engine_default(owner, key) and len(reason) > 20, key
        else:
            assert job == engine_default(owner, key), f"{section}.{key}: undocumented job default"
    assert {k for s, k in JOB_DEFAULTS if s == section} <= set(model.model_fields)


def test_the_job_builds_exactly_its_engine_config_and_sampling_params(tmp_path):
    job = make_job(tmp_path, "in.parquet", sampling={"temperature": 0.7, "n": 3, "stop": ["END"]},
                   model={"quantize_lm_head": True}, engine={"max_num_seqs": 7})
    config, params = job.engine_config(), job.sampling_params()
    assert config.model == job.model.path
    for section in (job.model, job.engine):
        for key, value in section.model_dump(exclude=set(MODEL_JOB_KEYS)).items():
            assert getattr(config, key) == value, key
    # The job's logprobs false is the engine's None (true: 0, N: N).
    own_names = [k for k in SamplingSection.model_fields if k not in SAMPLING_RENAMED]
    assert {k: getattr(params, k) for k in own_names} == {**job.sampling.model_dump(exclude=set(SAMPLING_RENAMED)),
                                                          "logprobs": None}
    assert params.structured_outputs is None and job.sampling.structured is None
    assert (config.quantize_lm_head, config.max_num_seqs, params.n, params.stop) == (True, 7, 3, ["END"])
    assert job.sampling_params(temperature=1.5).temperature == 1.5  # a row's override, same construction


def job_reference_page() -> str:
    """The site's job-file reference, as the docs build generates it from the config classes."""
    from batchgen.cli.reference import render_reference_pages

    return render_reference_pages()["reference/job-file.md"]


def names_key(page: str, section: str, key: str) -> bool:
    """The reference has a table row for `section.key` (a bare word could match any prose)."""
    return f"| `{section}.{key}` |" in page


@pytest.mark.parametrize("section, model, owner", SECTIONS)
def test_the_job_reference_names_every_key(section, model, owner):
    page = job_reference_page()
    assert [key for key in model.model_fields if not names_key(page, section, key)] == [], section
    python_api = (DOCS / "reference" / "python-api.md").read_text()
    for name in ENGINE_ONLY if owner is EngineConfig else SAMPLING_ONLY:
        assert f"`{name}`" in python_api  # said why it is not a job key


# ---- values: finite and in range, as the engine checks them ------------------------------------------

INF, NAN = float("inf"), float("nan")
BASE = {"name": "t", "model": {"path": "smollm2-135m-instruct"}, "input": {"path": "in.parquet"}}


def job_error(**sections) -> str:
    raw = {**BASE, **sections}
    with pytest.raises(JobError) as info:
        validate_job(raw, Path("."))
    return str(info.value)


@pytest.mark.parametrize("section, values, expected", [
    ("sampling", {"temperature": INF}, "sampling.temperature: must be in [1e-5, 100] or 0 (got inf)"),
    ("sampling", {"temperature": NAN}, "sampling.temperature: must be in [1e-5, 100] or 0 (got nan)"),
    ("sampling", {"temperature": 100.5}, "sampling.temperature: must be in [1e-5, 100] or 0 (got 100.5)"),
    ("sampling", {"top_p": 0.0}, "sampling.top_p: must be in (0, 1] (got 0.0)"),
    ("sampling", {"top_p": NAN}, "sampling.top_p: must be in (0, 1] (got nan)"),
    ("sampling", {"top_k": 0}, "sampling.top_k: must be -1 (off) or >= 1 (got 0)"),
    ("sampling", {"min_p": 1.5}, "sampling.min_p: must be in [0, 1] (got 1.5)"),
    ("sampling", {"min_p": NAN}, "sampling.min_p: must be in [0, 1] (got nan)"),
    ("sampling", {"repetition_penalty": INF}, "repetition_penalty: must be in [1e-6, 1e6] (got inf)"),
    ("sampling", {"repetition_penalty": 0.0}, "repetition_penalty: must be in [1e-6, 1e6] (got 0.0)"),
    ("sampling", {"repetition_penalty": NAN}, "repetition_penalty: must be in [1e-6, 1e6] (got nan)"),
    ("sampling", {"presence_penalty": -2.5}, "sampling.presence_penalty: must be in [-2, 2] (got -2.5)"),
    ("sampling", {"frequency_penalty": INF}, "sampling.frequency_penalty: must be in [-2, 2] (got inf)"),
    ("sampling", {"n": 0}, "sampling.n: must be in [1, 1024] (got 0)"),
    ("sampling", {"n": 10**9, "temperature": 1.0}, "sampling.n: must be in [1, 1024] (got 1000000000)"),
    ("sampling", {"max_tokens": 0}, "sampling.max_tokens: must be >= 1 (got 0)"),
    ("sampling", {"max_tokens": 10**9}, "sampling.max_tokens: must be below model.max_model_len (4096)"),
    ("sampling", {"min_tokens": -1}, "sampling.min_tokens: must be in [0, max_tokens] (got -1)"),
    ("sampling", {"stop": ["END", ""]}, "sampling.stop: must hold non-empty strings"),
    ("sampling", {"stop_token_ids": [-1]}, "sampling.stop_token_ids: must hold token ids >= 0 (got [-1])"),
    ("engine", {"block_size": 0}, "engine.block_size: must be >= 1 (got 0)"),
    ("engine", {"max_num_batched_tokens": -4}, "engine.max_num_batched_tokens: must be >= 1 (got -4)"),
    ("engine", {"kv_cache_memory": INF}, "engine.kv_cache_memory: must be auto, bytes"),
    ("engine", {"kv_cache_memory": NAN}, "engine.kv_cache_memory: must be auto, bytes"),
    ("engine", {"kv_cache_memory": 0}, "engine.kv_cache_memory: must be auto, bytes"),
    ("engine", {"device": "cuda:x"}, "engine.device: must be one of auto, cpu, cuda, cuda:N (got 'cuda:x')"),
    ("model", {"max_model_len": 1}, "model.max_model_len: must be >= 2 or null (got 1)"),
])
def test_out_of_range_and_non_finite_values_are_refused_naming_the_key(section, values, expected):
    raw_section = {**BASE.get(section, {}), **values}
    assert expected in job_error(**{section: raw_section})


def test_the_edges_of_each_range_are_accepted():
    job = validate_job({**BASE, "sampling": {
        "temperature": 100.0, "top_p": 1.0, "top_k": 1, "min_p": 1.0, "repetition_penalty": 1e-3,
        "presence_penalty": -2.0, "frequency_penalty": 2.0, "n": 1024, "max_tokens": 4095, "min_tokens": 4095,
        "stop_token_ids": [0]}, "engine": {"kv_cache_memory": 1.0}}, Path("."))
    assert job.sampling.n == 1024 and job.sampling.max_tokens == 4095
    model = {**BASE["model"], "max_model_len": 2}
    shortest = validate_job({**BASE, "model": model, "sampling": {"max_tokens": 1}}, Path("."))
    assert shortest.engine_config().max_model_len == 2


def test_a_yaml_inf_from_set_is_refused(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(BASE))
    with pytest.raises(JobError, match=r"sampling\.temperature: must be in \[1e-5, 100\] or 0 \(got inf\)"):
        load_job(path, ["sampling.temperature=.inf"])
    with pytest.raises(JobError, match=r"sampling\.repetition_penalty: must be in \[1e-6, 1e6\] \(got nan\)"):
        load_job(path, ["sampling.repetition_penalty=.nan"])


def test_bad_per_row_values_become_error_rows(tmp_path, fake_engine_for):
    temps = [0.5, INF, NAN, None, 200.0, -0.0]
    path = write_parquet(tmp_path / "in.parquet", {"id": list(range(6)), "prompt": [f"p{i}" for i in range(6)],
                                                   "temp": pa.array(temps, pa.float64())})  # None: job default
    job = make_job(tmp_path, str(path), sampling_columns={"temperature": "temp"})
    result = run_job(job, engine=fake_engine_for(job), progress=False)
    rows = {r["id"]: r for r in read_output(tmp_path / "out").to_pylist()}
    assert [i for i, r in rows.items() if r["error"] is None] == [0, 3, 5]
    for i, shown in ((1, "inf"), (2, "nan"), (4, "200.0")):
        assert f"invalid per-row sampling value (temp={shown})" in rows[i]["error"]
        assert "temperature must be in [1e-5, 100] or 0" in rows[i]["error"]
        assert rows[i]["finish_reason"] == "error"
    assert result.record.num_errors == 3


# ---- values the model bounds: checked from its config before any weight loads -----------------------

VOCAB, CONTEXT = 1000, 512


@pytest.fixture
def model_job(tmp_path, monkeypatch):
    """job_file(**sampling) on a model folder holding only the tiny model's config.json (no weights)."""
    from batchgen.engine.runner import executor

    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(executor, "load_model", refuse)
    model = tmp_path / "tiny"
    model.mkdir()
    config = tiny_config(VOCAB, eos_token_id=2, max_position_embeddings=CONTEXT)
    (model / "config.json").write_text(json.dumps(config))
    write_parquet(tmp_path / "in.parquet", {"id": [1, 2], "prompt": ["a", "b"]})

    def job_file(max_model_len: int | None = None, **sampling) -> Path:
        raw = {"name": "limits", "model": {"path": str(model), "max_model_len": max_model_len},
               "engine": {"device": "cpu"}, "input": {"path": "in.parquet"}, "sampling": sampling}
        path = tmp_path / "job.yaml"
        path.write_text(yaml.safe_dump(raw))
        return path

    return job_file


def invoke(*args: str):
    return CliRunner().invoke(cli.app, list(args))


@pytest.mark.parametrize("sampling, expected", [
    ({"max_tokens": CONTEXT}, f"sampling.max_tokens: must be below the model's own context length "
                              f"({CONTEXT}) since model.max_model_len is null (got {CONTEXT})"),
    ({"max_tokens": 10**9}, "sampling.max_tokens: must be below the model's own context length"),
    ({"stop_token_ids": [10**12], "min_tokens": 1},
     "sampling.stop_token_ids: [1000000000000] outside the vocabulary"),
    ({"stop_token_ids": [5, VOCAB]}, f"sampling.stop_token_ids: [{VOCAB}] outside the vocabulary"),
    ({"n": 10**9, "temperature": 1.0}, "sampling.n: must be in [1, 1024]"),
])
def test_validate_and_run_refuse_what_the_model_cannot_take_before_weights_load(model_job, sampling,
                                                                                expected):
    job_file = model_job(**sampling)
    for command in ("validate", "run"):
        result = invoke(command, str(job_file))
        assert result.exit_code == 2, (command, result.output)
        assert expected in result.stderr, (command, result.stderr)


def test_values_inside_the_model_pass_validate(model_job, engine, tmp_path):
    # validate reads the tokenizer and the weights' headers too: a whole model, with the same config
    write_tiny_model(tmp_path / "tiny", engine.tokenizer.hf, vocab_size=VOCAB)
    result = invoke("validate", str(model_job(max_tokens=CONTEXT - 1, stop_token_ids=[0, VOCAB - 1])))
    assert result.exit_code == 0, result.output
    # with max_model_len set, the job's own context is the bound (the model's is not read for it)
    assert invoke("validate", str(model_job(max_model_len=64, max_tokens=63))).exit_code == 0
    assert "below model.max_model_len (64)" in invoke("validate", str(model_job(max_model_len=64,
                                                                                max_tokens=64))).stderr


def defaults_table_rows() -> list[str]:
    """docs/reference/python-api.md's table of the defaults that differ between the engine, a job and the
    server, rendered from the code that sets them (JOB_DEFAULTS, SERVER_DEFAULTS and the engine's dataclasses)."""
    from batchgen.openai.protocol import SERVER_DEFAULTS

    owners = {section: owner for section, _, owner in SECTIONS}
    keys = sorted({*JOB_DEFAULTS, *(("sampling", key) for key in SERVER_DEFAULTS)})
    rows = []
    for section, key in keys:
        engine = engine_default(owners[section], key)
        job, job_reason = JOB_DEFAULTS.get((section, key), (engine, ""))
        server, server_reason = SERVER_DEFAULTS.get(key, (engine, "")) if section == "sampling" else (engine, "")
        reason = "; ".join(r for r in (f"job: {job_reason}" if job_reason else "",
                                       f"server: {server_reason}" if server_reason else "") if r)
        shown = [value if isinstance(value, str) else f"`{value!r}`" for value in (engine, job, server)]
        rows.append(f"| `{section}.{key}` | {' | '.join(shown)} | {reason.replace('|', '/')} |")
    return rows


def test_the_python_api_page_tables_every_default_that_differs():
    page = (DOCS / "reference" / "python-api.md").read_text()
    missing = [row for row in defaults_table_rows() if row not in page]
    assert missing == [], "docs/reference/python-api.md's defaults table is out of date; expected rows:\n" + \
        "\n".join(defaults_table_rows())
