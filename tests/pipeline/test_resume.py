"""Resume: a `batchgen run` killed with SIGKILL mid-job, rerun, finishes only what is missing; other configs refused."""

from __future__ import annotations

import json
import subprocess
from collections import Counter

import pytest
import yaml

from batchgen.pipeline.errors import JobError
from batchgen.pipeline.job import run_job
from tests.pipeline.cli_process import batchgen, part_files, sigkill_after_first_part
from tests.pipeline.conftest import FakeEngine, make_job, read_output, write_parquet

NUM_ROWS, N = 5, 2


@pytest.mark.subprocess
def test_sigkill_mid_job_then_rerun_finishes_only_the_missing_units(tmp_path, tiny_model):
    ids = [f"row-{i}" for i in range(NUM_ROWS)]
    write_parquet(tmp_path / "data" / "in.parquet", {"id": ids, "prompt": [f"Question {i}?" for i in ids]})
    job = {
        "name": "killed",
        "model": {"path": str(tiny_model), "dtype": "float32", "max_model_len": 128},
        # Two sequences at a time: units finish one after another, far apart enough to kill between.
        "engine": {"device": "cpu", "kv_cache_memory": "8MiB", "max_num_seqs": 2},
        "input": {"path": "data/in.parquet", "rows_per_unit": 1},
        "sampling": {"temperature": 0.9, "n": N, "seed": 3, "max_tokens": 8, "ignore_eos": True},
        "batching": {"window": 1},
    }
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))
    out = tmp_path / "out" / "killed"

    done_before = sigkill_after_first_part(batchgen("run", str(job_file), "--no-progress"), out)
    assert done_before, "killed after at least one unit file existed"
    assert not (out / "_SUCCESS").exists(), "killed before _SUCCESS"
    assert len(done_before) < NUM_ROWS

    rerun = subprocess.run(batchgen("run", str(job_file), "--no-progress", "--json"), check=False,
                           capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert f"skipping {len(done_before)} finished unit(s)" in rerun.stderr
    for name in done_before:
        assert name in rerun.stderr
    after = part_files(out)
    assert {name: after[name] for name in done_before} == done_before  # finished units were not rewritten
    assert sorted(after) == [f"part-{i:05d}.parquet" for i in range(NUM_ROWS)]

    rows = read_output(out)
    pairs = Counter(zip(rows.column("id").to_pylist(), rows.column("sample_index").to_pylist()))
    assert pairs == Counter({(i, s): 1 for i in ids for s in range(N)})  # input ids x n, each exactly once
    assert rows.column("error").null_count == rows.num_rows
    success = json.loads(rerun.stdout)
    assert success == json.loads((out / "_SUCCESS").read_text())
    assert success["resumed"] is True and success["num_rows"] == NUM_ROWS * N
    assert success["num_requests"] == NUM_ROWS


def test_a_different_config_is_refused_unless_overwrite(tmp_path):
    path = write_parquet(tmp_path / "in.parquet", {"id": [1, 2, 3], "prompt": ["a", "b", "c"]})
    first = make_job(tmp_path, str(path))
    run_job(first, engine=FakeEngine(first.engine_config()), progress=False)
    again = run_job(first, engine=FakeEngine(first.engine_config()), progress=False)
    assert again.num_units_run == 0  # complete: nothing to do

    changed = make_job(tmp_path, str(path), sampling={"temperature": 0.5})
    with pytest.raises(JobError, match=r"output.path: .*different job config.*--overwrite"):
        run_job(changed, engine=FakeEngine(changed.engine_config()), progress=False)
    result = run_job(changed, engine=FakeEngine(changed.engine_config()), overwrite=True, progress=False)
    assert result.num_units_run == 1 and result.record.config_hash == changed.config_hash()
    manifest = json.loads((tmp_path / "out" / "_batchgen.json").read_text())
    assert manifest["config_hash"] == changed.config_hash()

    # Only the knobs that do not change outputs may differ for a resume: engine and batching are fine.
    faster = make_job(tmp_path, str(path), sampling={"temperature": 0.5}, engine={"max_num_seqs": 2})
    assert run_job(faster, engine=FakeEngine(faster.engine_config()), progress=False).num_units_run == 0

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    stranger = make_job(tmp_path, str(path), output={"path": str(foreign)})
    with pytest.raises(JobError, match="not a batchgen output folder"):
        run_job(stranger, engine=FakeEngine(stranger.engine_config()), progress=False)


def test_the_folder_is_the_truth_a_deleted_unit_file_is_redone(tmp_path):
    path = write_parquet(tmp_path / "in.parquet", {"id": list(range(6)), "prompt": ["p"] * 6})
    job = make_job(tmp_path, str(path), input={"rows_per_unit": 2})
    run_job(job, engine=FakeEngine(job.engine_config()), progress=False)
    (tmp_path / "out" / "part-00001.parquet").unlink()
    result = run_job(job, engine=FakeEngine(job.engine_config()), progress=False)
    assert (result.num_units_run, result.num_units_skipped) == (1, 2)
    assert read_output(tmp_path / "out").column("id").to_pylist() == list(range(6))
    assert result.record.resumed is True and result.record.num_rows == 6
