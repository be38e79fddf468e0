"""A job with tensor_parallel_size 2 (gloo, 2 processes) whose worker is SIGKILLed mid-job: the run
exits non-zero within 60 s naming the rank, and a rerun completes with every row exactly once.

A tiny random-weight Llama (head_dim 16: the C attention kernels, which tensor parallelism needs on
the CPU) keeps the loads short; rank 0 and the worker each hold half its heads and MLP channels.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections import Counter

import pytest
import yaml

from tests.pipeline.cli_process import batchgen, part_files, sigkill_worker_after_first_part
from tests.pipeline.conftest import read_output, write_parquet
from tests.pipeline.tiny_model import write_tiny_model

pytestmark = pytest.mark.subprocess

NUM_ROWS = 24


def test_a_killed_worker_ends_the_run_naming_its_rank_and_the_rerun_completes(tmp_path, engine):
    model = write_tiny_model(tmp_path / "model", engine.tokenizer.hf, hidden=64, intermediate=128,
                             num_heads=4, num_kv_heads=2)
    ids = [f"row-{i}" for i in range(NUM_ROWS)]
    write_parquet(tmp_path / "data" / "in.parquet", {"id": ids, "prompt": [f"Question {i}?" for i in ids]})
    job = {
        "name": "tp-killed",
        "model": {"path": str(model), "dtype": "float32", "max_model_len": 128},
        "engine": {"device": "cpu", "kv_cache_memory": "8MiB", "max_num_seqs": 2, "tensor_parallel_size": 2},
        "input": {"path": "data/in.parquet", "rows_per_unit": 2},
        "sampling": {"temperature": 0.9, "seed": 3, "max_tokens": 24, "ignore_eos": True},
        "batching": {"window": 2},
    }
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))
    out = tmp_path / "out" / "tp-killed"

    with open(tmp_path / "stderr.txt", "w") as stderr:
        proc = sigkill_worker_after_first_part(batchgen("run", str(job_file), "--no-progress"), out, stderr)
        killed = time.monotonic()
        code = proc.wait(timeout=60)
    elapsed = time.monotonic() - killed
    message = (tmp_path / "stderr.txt").read_text()
    assert code == 1, message
    assert elapsed < 60
    assert "tensor-parallel worker rank 1" in message and "killed by SIGKILL" in message, message
    assert not (out / "_SUCCESS").exists()
    done_before = part_files(out)
    assert 0 < len(done_before) < NUM_ROWS // 2

    rerun = subprocess.run(batchgen("run", str(job_file), "--no-progress", "--json"), check=False,
                           capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert f"skipping {len(done_before)} finished unit(s)" in rerun.stderr
    after = part_files(out)
    assert {name: after[name] for name in done_before} == done_before  # finished units were not rewritten
    rows = read_output(out)
    assert Counter(rows.column("id").to_pylist()) == Counter({i: 1 for i in ids})  # every row exactly once
    assert rows.column("error").null_count == rows.num_rows
    success = json.loads(rerun.stdout)
    assert success["resumed"] is True and success["num_rows"] == NUM_ROWS
