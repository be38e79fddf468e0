"""Static shards: three shard processes (two at once) give a local run's rows; _SUCCESS once; kill -9 and
rerun; a changed config or shard count refused; Slurm / Kubernetes shard selection; finalize by hand."""

from __future__ import annotations

import json
import subprocess

import pytest
from typer.testing import CliRunner

from batchgen.cli.main import app
from batchgen.pipeline.config import load_job
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.shards import parse_shard
from tests.pipeline.cli_process import batchgen, sigkill_after_first_part
from tests.pipeline.conftest import read_output
from tests.pipeline.scale_helpers import (
    NGRAM,
    NUM_ROWS,
    assert_each_row_once,
    row_key,
    run_locally,
    write_job,
)


@pytest.fixture(scope="module")
def local_rows(tmp_path_factory, tiny_model):
    return run_locally(tmp_path_factory.mktemp("local"), tiny_model)


def shard_cmd(job_file, shard: str, *extra: str) -> list[str]:
    return batchgen("run", str(job_file), "--shard", shard, "--no-progress", *extra)


@pytest.mark.subprocess
def test_three_shard_processes_give_the_local_rows_and_one_success(tmp_path, tiny_model, local_rows):
    rows, local_record = local_rows
    job_file = write_job(tmp_path, tiny_model, engine=NGRAM)  # speculation changes no row
    out = tmp_path / "out" / "scaled"
    # Shard 2 in this process; shards 0 and 1 in two processes of their own, at the same time.
    first = CliRunner().invoke(app, ["run", str(job_file), "--shard", "2/3", "--no-progress"])
    assert first.exit_code == 0, first.output
    assert "waiting for other shards" in first.output and not (out / "_SUCCESS").exists()
    # The other two at the same time: both may find every unit committed; exactly one writes _SUCCESS.
    procs = [subprocess.Popen(shard_cmd(job_file, s), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for s in ("0/3", "1/3")]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e for _, e in outputs]
    assert sum("this shard wrote _SUCCESS" in o for o, _ in outputs) == 1, outputs

    assert row_key(read_output(out)) == rows  # ids, sample indexes, token ids: as the local run's
    success = json.loads((out / "_SUCCESS").read_text())
    for key in ("num_requests", "num_rows", "num_errors", "prompt_tokens", "completion_tokens",
                "kernels", "kv_cache", "weights"):  # the engine's reports came from the shards' engines
        assert success[key] == local_record[key], key
    # Each shard's draft and accepted tokens, summed at finalize, are a local run's with the same setting.
    _, local_spec_record = run_locally(tmp_path / "local-ngram", tiny_model, engine=NGRAM)
    assert success["speculative"] == local_spec_record["speculative"] and success["speculative"]["num_verifies"] > 0
    assert success["num_rows"] == NUM_ROWS
    assert success["provenance"] == local_spec_record["provenance"] and success["provenance"]["model"]["files"]
    workers = success["workers"]
    assert workers["backend"] == "shards" and workers["num_shards"] == 3
    assert sorted(s["index"] for s in workers["shards"]) == [0, 1, 2]
    assert all(s["source"] == "--shard" for s in workers["shards"])
    assert success["ttft_s"]["p50"] is not None  # percentiles over all rows of all shards
    summaries = sorted(p.name for p in (out / "_workers").iterdir())
    assert summaries == [f"shard-{i:05d}-of-00003.json" for i in range(3)]
    shard2 = json.loads((out / "_workers" / summaries[2]).read_text())
    assert shard2["units_run"] == [f"part-{k:05d}.parquet" for k in range(2, NUM_ROWS, 3)]


@pytest.mark.subprocess
def test_sigkilled_shard_rerun_and_refusals(tmp_path, tiny_model, local_rows):
    rows, _ = local_rows
    job_file = write_job(tmp_path, tiny_model, sampling={"max_tokens": 24})
    out = tmp_path / "out" / "scaled"
    sigkill_after_first_part(shard_cmd(job_file, "0/2"), out)
    committed = sorted(p.name for p in (out / "_commits").glob("*.json"))
    assert committed and len(committed) < NUM_ROWS // 2, committed

    runner = CliRunner()
    # A shard with a changed config, or another shard count, refuses before any generation (exit 2).
    changed = runner.invoke(app, ["run", str(job_file), "--shard", "1/2", "--no-progress",
                                  "--set", "sampling.seed=8"])
    assert changed.exit_code == 2 and "different job config" in changed.output, changed.output
    recorded = json.loads((out / "_batchgen.json").read_text())["config_hash"]
    assert recorded[:12] in changed.output and load_job(job_file, ["sampling.seed=8"]).config_hash()[:12] \
        in changed.output
    other_n = runner.invoke(app, ["run", str(job_file), "--shard", "1/3", "--no-progress"])
    assert other_n.exit_code == 2 and "started with 2 shards, this run says 3" in other_n.output, other_n.output

    # The rerun of the killed shard, and the other shard, in this process (no new interpreter to start).
    rerun = runner.invoke(app, ["run", str(job_file), "--shard", "0/2", "--no-progress"])
    assert rerun.exit_code == 0, rerun.output
    other = runner.invoke(app, ["run", str(job_file), "--shard", "1/2", "--no-progress", "--json"])
    assert other.exit_code == 0, other.output
    success = json.loads(other.stdout)
    assert success == json.loads((out / "_SUCCESS").read_text()) and success["num_rows"] == NUM_ROWS
    assert success["workers"]["replica_failures"] == 1  # shard 0's rerun found part of its shard done
    assert_each_row_once(out)

    # finalize by hand: _SUCCESS from the committed parts; a missing part is named (exit 1).
    (out / "_SUCCESS").unlink()
    again = runner.invoke(app, ["finalize", str(out), "--json"])
    assert again.exit_code == 0, again.output
    assert json.loads(again.output)["num_rows"] == NUM_ROWS and (out / "_SUCCESS").exists()
    (out / "_SUCCESS").unlink()
    (out / "part-00004.parquet").unlink()
    missing = runner.invoke(app, ["finalize", str(out)])
    assert missing.exit_code == 1 and "part-00004.parquet" in missing.output
    assert not (out / "_SUCCESS").exists()


def test_shard_selection_from_slurm_and_kubernetes():
    assert parse_shard("1/4") == parse_shard("1/4", env={"SLURM_ARRAY_TASK_ID": "3"})  # explicit wins
    slurm = parse_shard("auto", env={"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_MIN": "3",
                                     "SLURM_ARRAY_TASK_COUNT": "4"})
    assert (slurm.index, slurm.count, slurm.source) == (2, 4, "SLURM_ARRAY_TASK_ID")  # --array=3-6
    k8s = parse_shard("auto", num_shards=8, env={"JOB_COMPLETION_INDEX": "7"})
    assert (k8s.index, k8s.count, k8s.source) == (7, 8, "JOB_COMPLETION_INDEX")
    with pytest.raises(JobError, match="needs --num-shards"):
        parse_shard("auto", env={"JOB_COMPLETION_INDEX": "0"})
    with pytest.raises(JobError, match="neither SLURM_ARRAY_TASK_ID"):
        parse_shard("auto", env={})  # opt-in only: no variables, no sharding by surprise
    with pytest.raises(JobError, match="not one of 0..3"):
        parse_shard("auto", num_shards=4, env={"JOB_COMPLETION_INDEX": "4"})
    with pytest.raises(JobError, match="expected I/N"):
        parse_shard("2-of-3")
    assert [k for k in range(10) if parse_shard("1/3").owns(_Unit(k))] == [1, 4, 7]


class _Unit:
    def __init__(self, index: int):
        self.index = index


def test_shards_on_an_object_store_write_success_once(tmp_path, fake_engine_for):
    """memory:// stands for an object store: shared leases, the shard leases, conditional creates."""
    from batchgen.pipeline.shards import ShardSpec, run_shard
    from batchgen.pipeline.storage import Storage
    from tests.pipeline.conftest import make_job, write_parquet

    path = write_parquet(tmp_path / "in.parquet", {"id": list(range(7)), "prompt": [f"p{i}" for i in range(7)]})
    job = make_job(tmp_path, str(path), input={"rows_per_unit": 2}, output={"path": "memory://shards-test/out"})
    first = run_shard(job, ShardSpec(1, 2, "--shard"), engine=fake_engine_for(job), progress=False)
    assert first.finalized.missing == ["part-00000.parquet", "part-00002.parquet"] and not first.finalized.created
    second = run_shard(job, ShardSpec(0, 2, "--shard"), engine=fake_engine_for(job), progress=False)
    assert second.finalized.created and second.finalized.record.num_rows == 7
    assert second.finalized.record.model == job.model.path  # from the shards' engine reports
    storage = Storage("memory://shards-test/out")
    assert json.loads(storage.read_text("_SUCCESS")) == second.finalized.record.to_dict()
    again = run_shard(job, ShardSpec(0, 2, "--shard"), engine=fake_engine_for(job), progress=False)
    assert again.num_units_run == 0 and not again.finalized.created  # complete: nothing to do
