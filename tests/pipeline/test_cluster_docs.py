"""The scale-out docs hold: the job reference's cluster keys, the scale-out guide, the Slurm script and the
Kubernetes manifest (valid YAML, a Job that shards by its completion index, commands and flags that exist)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml
from typer.testing import CliRunner

from batchgen.cli.main import app
from batchgen.pipeline.config import ClusterSection
from tests.pipeline.test_job_schema import DOCS, job_reference_page, names_key

CLUSTER_DIR = Path(__file__).resolve().parents[2] / "jobs" / "cluster"


def options_of(command: str) -> set[str]:
    """The flags `batchgen COMMAND --help` lists (from the app itself, so a renamed flag fails here)."""
    result = CliRunner().invoke(app, [command, "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    return set(re.findall(r"--[a-z][a-z-]*", result.output))


def test_the_docs_document_the_cluster_section_and_the_flags():
    reference = job_reference_page()
    assert "## `cluster`" in reference
    assert [key for key in ClusterSection.model_fields if not names_key(reference, "cluster", key)] == []
    section = (DOCS / "guides" / "scale-out.md").read_text()
    for key in ClusterSection.model_fields:
        assert f"`{key}`" in section, key
    for needed in ("ray start --head", "--set cluster.backend=ray", "--shard I/N", "--shard auto",
                   "--num-shards", "batchgen finalize OUT", "jobs/cluster/slurm_array.sh",
                   "jobs/cluster/k8s_indexed_job.yaml", "EngineReplica", "exit 2", "exit 1"):
        assert needed in section, needed
    for flag in ("--shard", "--num-shards"):
        assert flag in options_of("run")


def test_the_slurm_script_runs_batchgen_with_flags_that_exist():
    script = (CLUSTER_DIR / "slurm_array.sh").read_text()
    assert script.startswith("#!/bin/bash")
    array = re.search(r"^#SBATCH --array=(\d+)-(\d+)", script, re.M)
    assert array and int(array.group(1)) == 0  # shard = task id - SLURM_ARRAY_TASK_MIN: any start works
    command = next(line for line in script.splitlines() if "batchgen run" in line and not line.startswith("#"))
    words = shlex.split(command)
    words = words[words.index("batchgen"):]
    assert words[:2] == ["batchgen", "run"]
    flags = {w for w in words if w.startswith("--")}
    assert "--shard" in flags and words[words.index("--shard") + 1] == "auto"
    assert flags <= options_of("run"), flags - options_of("run")


def test_the_kubernetes_manifest_is_an_indexed_job_whose_shards_match_its_completions():
    manifest = yaml.safe_load((CLUSTER_DIR / "k8s_indexed_job.yaml").read_text())
    assert (manifest["apiVersion"], manifest["kind"]) == ("batch/v1", "Job")
    spec = manifest["spec"]
    assert spec["completionMode"] == "Indexed"
    container = spec["template"]["spec"]["containers"][0]
    command = container["command"] + container["args"]
    assert command[:2] == ["batchgen", "run"]
    assert command[command.index("--shard") + 1] == "auto"
    assert int(command[command.index("--num-shards") + 1]) == spec["completions"]
    assert {w for w in command if w.startswith("--")} <= options_of("run")
    overrides = [command[i + 1] for i, w in enumerate(command) if w == "--set"]
    assert all(re.fullmatch(r"[a-z_]+\.[a-z_]+=\S+", o) for o in overrides)
