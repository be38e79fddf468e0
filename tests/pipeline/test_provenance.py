"""Provenance: every setting that made a run's rows, in `_SUCCESS` and each part's metadata; `report --against`
diffs it key by key; `batchgen card` writes a dataset card the Hugging Face Hub's parser reads back."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from batchgen.cli.main import app
from batchgen.engine.loader.source import resolve_model
from batchgen.pipeline.job import run_job
from batchgen.pipeline.provenance import PARQUET_KEY
from tests.conftest import MODEL
from tests.pipeline.conftest import make_job, write_parquet


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, engine):
    """Two runs of the same prompts that differ only in temperature and system prompt."""
    tmp = tmp_path_factory.mktemp("provenance")
    write_parquet(tmp / "in.parquet", {"id": [1, 2, 3], "prompt": ["Name a colour.", "Count to three.", "Say hi."]})
    folders = []
    for name, temperature, system in (("warm", 0.8, "You are verbose."), ("cool", 0.3, "You are brief.")):
        job = make_job(tmp, str(tmp / "in.parquet"), output={"path": str(tmp / name)},
                       input={"system_prompt": system},
                       sampling={"temperature": temperature, "seed": 7, "max_tokens": 4})
        run_job(job, engine=engine, progress=False)
        folders.append(tmp / name)
    return folders


def test_success_and_every_part_hold_the_resolved_configuration(two_runs, engine):
    warm = two_runs[0]
    provenance = json.loads((warm / "_SUCCESS").read_text())["provenance"]
    assert provenance["sampling"]["temperature"] == 0.8 and provenance["sampling"]["seed"] == 7
    assert provenance["sampling"]["max_tokens"] == 4 and "top_p" in provenance["sampling"]  # every key
    assert provenance["input"]["system_prompt"] == "You are verbose."
    assert provenance["model"]["path"] == MODEL and provenance["model"]["dtype"] == "float32"
    assert provenance["model"]["max_model_len"] == 256 and provenance["engine"]["device"] == "cpu"
    template = engine.tokenizer.hf.chat_template
    assert provenance["chat_template_sha256"] == hashlib.sha256(template.encode()).hexdigest()
    source = resolve_model(MODEL)
    files = provenance["model"]["files"]
    assert list(files) == [source.gguf_file]
    weights = source.folder / source.gguf_file
    assert files[source.gguf_file] == {"size": weights.stat().st_size,
                                       "sha256": hashlib.sha256(weights.read_bytes()).hexdigest()}
    assert provenance["generation_config"]["setting"] is not None
    for part in sorted(warm.glob("part-*.parquet")):
        assert json.loads(pq.read_metadata(part).metadata[PARQUET_KEY]) == provenance


def test_report_against_names_each_changed_key_with_both_values(two_runs, tmp_path):
    warm, cool = two_runs
    result = CliRunner().invoke(app, ["report", str(warm), "--against", str(cool), "-o", str(tmp_path / "r.html")])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "  provenance.sampling.temperature: 0.8 vs 0.3" in lines
    assert '  provenance.input.system_prompt: "You are verbose." vs "You are brief."' in lines
    changed = {line.split(":")[0].strip() for line in lines if line.startswith("  provenance.")}
    assert changed == {"provenance.sampling.temperature", "provenance.input.system_prompt"}


def test_the_dataset_card_round_trips_through_the_hub_parser(two_runs, tmp_path):
    huggingface_hub = pytest.importorskip("huggingface_hub")
    datasets = pytest.importorskip("datasets")
    warm = two_runs[0]
    result = CliRunner().invoke(app, ["card", str(warm), "-o", str(tmp_path / "README.md")])
    assert result.exit_code == 0, result.output
    assert f"written to {tmp_path / 'README.md'}" in result.output
    card = huggingface_hub.DatasetCard.load(tmp_path / "README.md")  # a local path: no network
    data = card.data.to_dict()
    assert "license" not in data  # left to the user
    schema = pq.read_schema(sorted(warm.glob("part-*.parquet"))[0])
    expected = datasets.Features.from_arrow_schema(pa.schema(list(schema)))._to_yaml_list()
    assert data["dataset_info"]["features"] == expected
    assert datasets.Features._from_yaml_list(data["dataset_info"]["features"]) == \
        datasets.Features.from_arrow_schema(pa.schema(list(schema)))
    assert data["dataset_info"]["splits"][0]["num_examples"] == 3
    assert data["configs"] == [{"config_name": "default", "data_files": [{"split": "train", "path": "part-*.parquet"}]}]
    success = json.loads((warm / "_SUCCESS").read_text())
    reasons = [r for p in sorted(warm.glob("part-*.parquet"))
               for r in pq.read_table(p, columns=["finish_reason"]).column(0).to_pylist()]
    for reason in set(reasons):
        assert f"| {reason} | {reasons.count(reason):,} |" in card.text
    assert json.dumps(success["provenance"]["sampling"]["temperature"]) in card.text
    assert success["provenance"]["chat_template_sha256"] in card.text


def test_card_refuses_an_unfinished_folder(tmp_path: Path):
    (tmp_path / "out").mkdir()
    write_parquet(tmp_path / "out" / "part-00000.parquet", {"id": [1], "finish_reason": ["stop"]})
    result = CliRunner().invoke(app, ["card", str(tmp_path / "out")])
    assert result.exit_code == 2 and "no _SUCCESS" in result.output
