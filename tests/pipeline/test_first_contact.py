"""What a first `batchgen run` prints (issue 40): no allocator line and the kernels once (in the summary)
at default verbosity, both with --verbose; and a command that writes a file says where."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml
from typer.testing import CliRunner

from batchgen.cli import main as cli
from tests.pipeline.cli_process import batchgen
from tests.pipeline.conftest import write_parquet


@pytest.mark.subprocess
def test_start_up_prints_no_allocator_line_and_the_kernels_once_unless_verbose(tmp_path, tiny_model):
    write_parquet(tmp_path / "data" / "in.parquet", {"id": ["a", "b"], "prompt": ["Hi", "Hello there"]})
    job = {"name": "first", "model": {"path": str(tiny_model), "dtype": "float32", "max_model_len": 128},
           "engine": {"device": "cpu", "kv_cache_memory": "8MiB"},
           "input": {"path": "data/in.parquet"}, "sampling": {"max_tokens": 4}}
    path = tmp_path / "first.yaml"
    path.write_text(yaml.safe_dump(job))

    def run(*flags: str) -> subprocess.CompletedProcess:
        done = subprocess.run(batchgen("run", str(path), "--no-progress", "--overwrite", *flags),
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done

    quiet = run()
    assert "glibc malloc" not in quiet.stderr and "kernels:" not in quiet.stderr, quiet.stderr
    assert "oneDNN" not in quiet.stderr
    assert (quiet.stdout + quiet.stderr).count("attention_backend") == 1  # the summary's kernels row
    assert f"success file          {tmp_path / 'out' / 'first' / '_SUCCESS'}" in quiet.stdout
    verbose = run("--verbose")
    assert "batchgen: kernels: device cpu, attention_backend" in verbose.stderr
    # Raised once per process: shown with --verbose on Linux with glibc, where this suite runs.
    assert "batchgen: glibc malloc: mmap and trim thresholds raised" in verbose.stderr


def test_bench_output_says_where_it_wrote(tmp_path, monkeypatch):
    from batchgen.bench import machine, overhead

    monkeypatch.setattr(overhead, "run_overhead", lambda **kwargs: {"workload": "overhead", "steps": kwargs["steps"]})
    monkeypatch.setattr(machine, "machine_fingerprint", lambda: {"cpu": "test"})
    target = tmp_path / "results" / "overhead.json"
    result = CliRunner().invoke(cli.app, ["bench", "--workload", "overhead", "--output-len", "3", "--json",
                                          "--output", str(target)])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["steps"] == 3  # stdout stays the JSON alone
    assert json.loads(target.read_text())["steps"] == 3
    assert f"batchgen bench: result written to {target}" in result.stderr
