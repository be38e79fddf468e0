"""Bounded loss: finished rows reach `_checkpoints/` every output.checkpoint_seconds, so a run that dies
mid-window loses at most that much work; the rerun reuses the rest and writes the same parts."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from batchgen.pipeline.job import run_job
from batchgen.pipeline.output import CHECKPOINTS_DIR
from tests.pipeline.cli_process import batchgen
from tests.pipeline.conftest import FakeEngine, make_job, write_parquet

# Columns that must not differ between an interrupted-and-resumed run and one that ran straight through
# (the latency columns measure the run, and cached_tokens the prefix cache's state at the time).
EXACT = ["id", "sample_index", "completion", "completion_token_ids", "finish_reason", "prompt_tokens",
         "completion_tokens", "error"]
NUM_ROWS, N = 400, 2
CHECKPOINT_SECONDS = 0.03  # 3 steps of a SteppingEngine: the crash at step 50 may lose about 4 of them


class SteppingEngine(FakeEngine):
    """A FakeEngine whose steps take a little time, that dies at step `fail_step` (a crash: the run's
    writer gets no chance to save anything more) and counts the requests it finished before that."""

    def __init__(self, config, fail_step: int | None = None, step_seconds: float = 0.01):
        super().__init__(config)
        self.fail_step = fail_step
        self.step_seconds = step_seconds
        self.num_finished = 0
        self.finished_at: list[tuple[float, int]] = []  # (when a step returned, requests finished by then)
        self.crashed_at: float | None = None

    def step(self):
        if self.num_steps == self.fail_step:
            self.crashed_at = time.monotonic()
            raise RuntimeError("killed")
        time.sleep(self.step_seconds)
        outputs = super().step()
        self.num_finished += len(outputs)
        self.finished_at.append((time.monotonic(), self.num_finished))
        return outputs


def _job(tmp_path, where: str, s3_options: dict, name: str):
    ids = [f"q{i:04d}" for i in range(NUM_ROWS)]
    # Prompt lengths vary, so the window's length order interleaves every unit's rows.
    table = pa.table({"id": ids, "prompt": [f"Question {i}? " + "x" * (i * 7 % 23) for i in range(NUM_ROWS)]})
    if where == "s3":
        fs = fsspec.filesystem("s3", **s3_options)
        with fs.open(f"batchgen-test/{name}/in/prompts.parquet", "wb") as f:
            pq.write_table(table, f)
        job = make_job(tmp_path, f"s3://batchgen-test/{name}/in/prompts.parquet",
                       output={"path": f"s3://batchgen-test/{name}/out", "storage_options": s3_options,
                               "checkpoint_seconds": CHECKPOINT_SECONDS},
                       input={"rows_per_unit": 50}, sampling={"n": N, "temperature": 0.5, "seed": 1, "max_tokens": 4}, engine={"max_num_seqs": 4})
        job.input.storage_options = s3_options
        return job, fsspec.filesystem("s3", **s3_options), f"batchgen-test/{name}/out"
    write_parquet(tmp_path / name / "in.parquet", table)
    job = make_job(tmp_path, str(tmp_path / name / "in.parquet"),
                   output={"path": str(tmp_path / name / "out"), "checkpoint_seconds": CHECKPOINT_SECONDS},
                   input={"rows_per_unit": 50}, sampling={"n": N, "temperature": 0.5, "seed": 1, "max_tokens": 4}, engine={"max_num_seqs": 4})
    return job, fsspec.filesystem("file"), str(tmp_path / name / "out")


def _parts(fs, root: str) -> pa.Table:
    names = sorted(p for p in fs.ls(root, detail=False) if re.search(r"part-\d+\.parquet$", p))
    tables = []
    for name in names:
        with fs.open(name, "rb") as f:
            tables.append(pq.read_table(f))
    return pa.concat_tables(tables)


def _num_committed_rows(fs, root: str) -> int:
    commits = fs.ls(f"{root}/_commits", detail=False) if fs.exists(f"{root}/_commits") else []
    return sum(json.loads(fs.cat_file(c))["num_rows"] for c in commits if c.endswith(".json"))


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_crash_mid_window_loses_at_most_the_last_checkpoint(tmp_path, where, request):
    s3_options = request.getfixturevalue("s3_options") if where == "s3" else {}
    job, fs, root = _job(tmp_path, where, s3_options, f"crash-{where}")
    crashing = SteppingEngine(job.engine_config(), fail_step=NUM_ROWS // 4 // 2)  # 4 requests a step: ~50%
    with pytest.raises(RuntimeError, match="killed"):
        run_job(job, engine=crashing, progress=False)
    finished_rows = crashing.num_finished * N
    assert 0.4 * NUM_ROWS * N <= finished_rows <= 0.6 * NUM_ROWS * N
    committed_rows = _num_committed_rows(fs, root)
    assert committed_rows < finished_rows  # the window left most units open: parts alone would lose them
    assert fs.ls(f"{root}/{CHECKPOINTS_DIR}")

    rerun_engine = SteppingEngine(job.engine_config())
    result = run_job(job, engine=rerun_engine, progress=False)
    # The bound itself: every request that finished one checkpoint interval (and the step that noticed
    # it) before the crash was saved.
    times = [at for at, _ in crashing.finished_at] + [crashing.crashed_at]
    longest_step = max(b - a for a, b in zip(times, times[1:]))  # a loaded machine stretches steps
    bound = crashing.crashed_at - CHECKPOINT_SECONDS - longest_step
    saved_by_then = max((count for at, count in crashing.finished_at if at <= bound), default=0) * N
    assert result.num_rows_reused + committed_rows >= saved_by_then
    assert result.num_rows_reused + committed_rows >= 0.9 * finished_rows
    assert len(rerun_engine.added) * N == NUM_ROWS * N - result.num_rows_reused - committed_rows  # none twice
    assert result.record.resumed and result.record.num_rows == NUM_ROWS * N
    assert not fs.exists(f"{root}/{CHECKPOINTS_DIR}")  # the parts replaced the checkpoints

    resumed = _parts(fs, root)
    pairs = Counter(zip(resumed.column("id").to_pylist(), resumed.column("sample_index").to_pylist()))
    assert pairs == Counter({(f"q{i:04d}", s): 1 for i in range(NUM_ROWS) for s in range(N)})
    straight_job, fs2, root2 = _job(tmp_path, where, s3_options, f"straight-{where}")
    run_job(straight_job, engine=SteppingEngine(job.engine_config(), step_seconds=0), progress=False)
    assert resumed.select(EXACT).equals(_parts(fs2, root2).select(EXACT))  # same rows, same order, same parts
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False) if "part-" in p) == \
        [f"part-{i:05d}.parquet" for i in range(NUM_ROWS // 50)]


def _durable_rows(out: Path) -> int:
    """Output rows a kill would not lose: in committed parts and in checkpoints."""
    rows = sum(json.loads(c.read_text())["num_rows"] for c in (out / "_commits").glob("*.json"))
    for checkpoint in (out / CHECKPOINTS_DIR).glob("*.parquet"):
        try:
            rows += pq.ParquetFile(checkpoint).metadata.num_rows
        except Exception:  # noqa: BLE001 - renamed in place while we looked: counted next time
            continue
    return rows


@pytest.mark.subprocess
def test_kill_9_at_half_then_rerun_reuses_the_checkpointed_rows(tmp_path, tiny_model):
    num_rows, n = 48, 2
    ids = [f"row-{i}" for i in range(num_rows)]
    write_parquet(tmp_path / "data" / "in.parquet",
                  {"id": ids, "prompt": [f"Question {i}? " + "y" * (i % 9) for i in range(num_rows)]})

    def job_file(name: str) -> Path:
        job = {"name": name, "model": {"path": str(tiny_model), "dtype": "float32", "max_model_len": 128},
               "engine": {"device": "cpu", "kv_cache_memory": "8MiB", "max_num_seqs": 4},
               "input": {"path": "data/in.parquet", "rows_per_unit": 16},  # the default window: 8192
               "sampling": {"temperature": 0.9, "n": n, "seed": 3, "max_tokens": 8, "ignore_eos": True},
               "output": {"checkpoint_seconds": 0.1}}
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(job))
        return path

    out = tmp_path / "out" / "killed"
    proc = subprocess.Popen(batchgen("run", str(job_file("killed")), "--no-progress"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while _durable_rows(out) < num_rows * n // 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it could be killed mid-job"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    durable = _durable_rows(out)
    committed = sum(json.loads(c.read_text())["num_rows"] for c in (out / "_commits").glob("*.json"))
    assert durable >= num_rows * n // 2 and not (out / "_SUCCESS").exists()

    rerun = subprocess.run(batchgen("run", str(job_file("killed")), "--no-progress"), check=False,
                           capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    reused = int(re.search(r"([\d,]+) row\(s\) reused from checkpoints", rerun.stdout).group(1).replace(",", ""))
    assert reused + committed == durable  # every row that was durable at the kill, none generated again
    assert not (out / CHECKPOINTS_DIR).exists()

    straight = subprocess.run(batchgen("run", str(job_file("straight")), "--no-progress"), check=False,
                              capture_output=True, text=True, timeout=300)
    assert straight.returncode == 0, straight.stderr
    resumed, whole = _parts(fsspec.filesystem("file"), str(out)), _parts(fsspec.filesystem("file"),
                                                                       str(tmp_path / "out" / "straight"))
    pairs = Counter(zip(resumed.column("id").to_pylist(), resumed.column("sample_index").to_pylist()))
    assert pairs == Counter({(i, s): 1 for i in ids for s in range(n)})
    assert resumed.select(EXACT).equals(whole.select(EXACT))
    assert resumed.column("cumulative_logprob").to_pylist() == pytest.approx(
        whole.column("cumulative_logprob").to_pylist(), abs=1e-4)
