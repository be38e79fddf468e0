"""Hugging Face repo ids (`org/name`, at a revision) found in the local HF cache with HF_HUB_OFFLINE=1:
through LLM, a job run, `batchgen validate` and `batchgen plan` (`batchgen serve`: tests/serve/
test_vllm_serving.py); a missing repo id names the cache searched; a download is tried only where
the Hub may be reached.
"""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import yaml
from typer.testing import CliRunner

from batchgen.cli.main import app
from batchgen.engine import LLM, SamplingParams
from batchgen.engine.loader.source import resolve_model
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.job import run_job
from tests.engine.prompts import chat
from tests.hub_cache import MAIN_COMMIT, MISSING_REPO_ID, V1_COMMIT, make_hub_cache
from tests.pipeline.conftest import PIPELINE_ENGINE_KWARGS, engine_sections, make_job, write_parquet


@pytest.fixture(scope="module")
def hub(tmp_path_factory, smollm_path):
    return make_hub_cache(tmp_path_factory.mktemp("hf-cache"), smollm_path)


@pytest.fixture(autouse=True)
def offline_cache(hub, monkeypatch):
    for name, value in hub.env.items():
        monkeypatch.setenv(name, value)


@pytest.fixture(scope="module")
def hub_llm(hub, smollm_path):
    """The bundled model loaded by its repo id at the tag v1, with the pipeline's engine settings."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in hub.env.items():
            patch.setenv(name, value)
        return LLM(hub.repo_id, revision="v1", **PIPELINE_ENGINE_KWARGS)


def test_a_repo_id_resolves_to_its_snapshot_at_main_or_a_revision(hub, smollm_path):
    for revision, commit in ((None, MAIN_COMMIT), ("main", MAIN_COMMIT), ("v1", V1_COMMIT), (V1_COMMIT, V1_COMMIT)):
        source = resolve_model(hub.repo_id, revision)
        assert (source.folder, source.gguf_file) == (hub.snapshot(commit), smollm_path.name), revision


def test_llm_loads_a_repo_id_at_a_revision_and_generates_as_the_bundled_model(hub_llm, llm, hub):
    assert hub_llm.engine.loaded.source.folder == hub.snapshot(V1_COMMIT)
    prompt = chat("Name a color.")
    params = SamplingParams(temperature=0, max_tokens=6)
    assert hub_llm.chat(prompt, params)[0].outputs[0].token_ids == llm.chat(prompt, params)[0].outputs[0].token_ids


def test_a_job_runs_validates_and_plans_a_repo_id_at_a_revision(hub_llm, hub, tmp_path):
    inputs = write_parquet(tmp_path / "in.parquet", {"id": [1, 2], "prompt": ["Hi", "Name a fruit."]})
    sections = engine_sections(model=hub.repo_id)
    sections["model"]["revision"] = "v1"
    job = make_job(tmp_path, str(inputs), **sections)
    record = run_job(job, engine=hub_llm.engine, progress=False).record
    assert record.model == hub.repo_id and record.num_rows == 2 and record.num_errors == 0
    rows = pq.read_table(tmp_path / "out" / "part-00000.parquet").to_pylist()
    expected = hub_llm.chat([chat("Hi"), chat("Name a fruit.")], SamplingParams(temperature=0, max_tokens=4))
    assert [r["completion_token_ids"] for r in rows] == [e.outputs[0].token_ids for e in expected]

    job_file = tmp_path / "job.yaml"
    raw = {"name": "hub", "model": {"path": hub.repo_id, "revision": "v1", "max_model_len": 256},
           "input": {"path": str(inputs)}, "sampling": {"max_tokens": 8},
           "output": {"path": str(tmp_path / "out2")}}
    job_file.write_text(yaml.safe_dump(raw))
    validated = CliRunner().invoke(app, ["validate", str(job_file)])
    assert validated.exit_code == 0, validated.output
    assert f"{hub.repo_id} -> {hub.snapshot(V1_COMMIT)}" in validated.stdout

    planned = CliRunner().invoke(app, ["plan", hub.repo_id, "--revision", "v1", "--json"])
    assert planned.exit_code == 0, planned.output
    plan = json.loads(planned.stdout)
    assert plan["model"] == hub.repo_id and plan["max_model_len"] == 8192  # SmolLM2's own context
    from_job = CliRunner().invoke(app, ["plan", str(job_file), "--json"])
    assert from_job.exit_code == 0 and json.loads(from_job.stdout)["max_model_len"] == 256


def test_a_missing_repo_id_or_revision_names_the_cache_searched(hub, tmp_path):
    with pytest.raises(FileNotFoundError, match=f"nor in the Hugging Face cache {hub.root}, and HF_HUB_OFFLINE is set"):
        resolve_model(MISSING_REPO_ID)
    with pytest.raises(FileNotFoundError, match="at revision 'v9'"):
        resolve_model(hub.repo_id, "v9")
    with pytest.raises(ValueError, match="revision 'v1' applies to Hugging Face repo ids"):
        resolve_model("smollm2-135m-instruct", "v1")

    job_file = tmp_path / "job.yaml"
    for model, key in (({"path": MISSING_REPO_ID}, "model.path"), ({"path": hub.repo_id, "revision": "v9"},
                                                                    "model.revision")):
        job_file.write_text(yaml.safe_dump({"name": "hub", "model": model, "input": {"path": "in.parquet"}}))
        result = CliRunner().invoke(app, ["validate", str(job_file)])
        assert result.exit_code == 2
        assert f"{key}: " in result.stderr and str(hub.root) in result.stderr
    result = CliRunner().invoke(app, ["plan", MISSING_REPO_ID])
    assert result.exit_code == 2 and str(hub.root) in result.stderr


def test_a_repo_id_not_in_the_cache_is_downloaded_only_when_not_offline(hub, smollm_path, tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    calls = []

    def snapshot_download(repo_id, *, revision, cache_dir, local_files_only=False, allow_patterns=None):
        calls.append((repo_id, revision, local_files_only, allow_patterns))
        if local_files_only:
            raise LocalEntryNotFoundError("not cached")
        folder = tmp_path / "downloaded"
        if not folder.exists():
            folder.mkdir()
            (folder / smollm_path.name).symlink_to(smollm_path)
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE is set"):
        resolve_model(MISSING_REPO_ID)
    assert [c[2] for c in calls] == [True]  # offline: the cache only
    monkeypatch.delenv("HF_HUB_OFFLINE")
    source = resolve_model(MISSING_REPO_ID, "v2")
    assert source.folder == tmp_path / "downloaded" and source.gguf_file == smollm_path.name
    assert calls[1][:3] == (MISSING_REPO_ID, "v2", True)
    assert calls[2][:3] == (MISSING_REPO_ID, "v2", False) and "*.safetensors" in calls[2][3]
    # Capacity planning reads the config alone: only config.json is fetched.
    calls.clear()
    resolve_model(MISSING_REPO_ID, config_only=True)
    assert calls[1][2:] == (False, ["config.json"])


def test_a_repo_id_in_a_job_file_is_a_name_and_a_folder_of_that_name_is_a_path(tmp_path):
    from batchgen.pipeline.config import apply_override, validate_job

    raw = {"name": "j", "model": {"path": "TestOrg/model"}, "input": {"path": "in.parquet"}}
    assert validate_job(raw, tmp_path).model.path == "TestOrg/model"
    (tmp_path / "TestOrg" / "model").mkdir(parents=True)
    assert validate_job(raw, tmp_path).model.path == str(tmp_path / "TestOrg" / "model")
    apply_override(raw, "model.path=TestOrg/other")
    assert raw["model"]["path"] == "TestOrg/other"
    with pytest.raises(JobError, match="model.revision: must be a branch, tag or commit name"):
        validate_job({**raw, "model": {"path": "TestOrg/other", "revision": " "}}, tmp_path)
