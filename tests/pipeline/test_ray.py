"""Ray backend on one local cluster (2 CPUs, 127.0.0.1): two replicas give a local run's rows; a replica
killed mid-job, and replicas that keep dying; a local output path that other nodes do not see is refused."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from typer.testing import CliRunner

from batchgen.cli.main import app
from batchgen.pipeline.config import load_job
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.job import run_job
from batchgen.pipeline.provenance import PARQUET_KEY
from batchgen.pipeline.ray_driver import run_on_ray
from tests.pipeline.conftest import read_output, write_parquet
from tests.pipeline.ray_helpers import Killer, local_ray_cluster, replica_pids
from tests.pipeline.scale_helpers import (
    NGRAM,
    NUM_ROWS,
    assert_each_row_once,
    row_key,
    run_locally,
    write_job,
)

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def ray_cluster():
    with local_ray_cluster() as cluster:
        yield cluster


@pytest.fixture(scope="module")
def local_rows(tmp_path_factory, tiny_model):
    return run_locally(tmp_path_factory.mktemp("local"), tiny_model)[0]


RAY = {"backend": "ray", "replicas": 2}


def test_a_local_output_path_other_nodes_do_not_see_is_refused(tmp_path, ray_cluster, tiny_model):
    job = load_job(write_job(tmp_path, tiny_model, cluster=RAY))
    out = tmp_path / "out" / "scaled"

    def blind_node(ray_module, path):  # a second machine whose disk does not hold the driver's folder
        seen = {"head": open(path).read()}
        seen["node-2 (10.0.0.2)"] = None
        return seen

    with pytest.raises(JobError, match=r"node\(s\) node-2 \(10.0.0.2\) do not see the folder"):
        run_on_ray(job, progress=False, probe=blind_node)
    # Refused before any replica started (this test runs first in the module: no replica ever ran).
    assert not list(out.glob("part-*")) and replica_pids() == []
    assert not list(out.glob("_batchgen.probe-*"))  # the probe file is removed


def test_two_replicas_give_the_local_rows(tmp_path, ray_cluster, tiny_model, local_rows):
    # With n-gram speculation on the replicas: the same rows as the local run without it.
    result = run_job(load_job(write_job(tmp_path, tiny_model, cluster=RAY, engine=NGRAM)), progress=False)
    out = tmp_path / "out" / "scaled"
    assert row_key(read_output(out)) == local_rows
    record = json.loads((out / "_SUCCESS").read_text())
    assert record == result.record.to_dict() and record["num_rows"] == NUM_ROWS
    workers = record["workers"]
    assert (workers["backend"], workers["num_workers"], workers["replica_failures"]) == ("ray", 2, 0)
    assert len({r["pid"] for r in workers["replicas"]}) == 2  # two engines did the work
    # The replicas' engine reports reach _SUCCESS as a local run's do (float32 tiny model).
    assert record["kernels"]["device"] == "cpu" and record["kv_cache"]["dtype"] == "float32"
    assert record["kv_cache"]["bytes_per_token"] > 0 and record["weights"]["origin"] == "float"
    # The replicas' draft and accepted tokens, summed over units, are the local run's.
    _, local_spec_record = run_locally(tmp_path / "local-ngram", tiny_model, engine=NGRAM)
    assert record["speculative"] == local_spec_record["speculative"]
    assert record["speculative"]["num_verifies"] > 0  # the job did speculate
    # How the rows were made: the replicas' provenance in _SUCCESS and every part, as a local run gives it.
    provenance = record["provenance"]
    assert provenance["engine"]["speculative"] == local_spec_record["provenance"]["engine"]["speculative"]
    assert provenance == local_spec_record["provenance"]
    assert provenance["model"]["files"] and provenance["chat_template_sha256"]
    for part in sorted(out.glob("part-*.parquet")):
        assert json.loads(pq.read_metadata(part).metadata[PARQUET_KEY]) == provenance
    deadline = time.monotonic() + 30
    while replica_pids() and time.monotonic() < deadline:  # ray.kill returns before the process is gone
        time.sleep(0.1)
    assert replica_pids() == []  # the driver stops its replicas


def test_a_replica_killed_mid_job_loses_no_row(tmp_path, ray_cluster, tiny_model, local_rows):
    job = load_job(write_job(tmp_path, tiny_model, cluster=RAY))
    out = tmp_path / "out" / "scaled"
    killer = Killer(out, after_commits=2, count=1)
    killer.start()
    result = run_job(job, progress=False)
    killer.stop.set()
    assert len(killer.killed) == 1
    assert_each_row_once(out)
    assert row_key(read_output(out)) == local_rows
    workers = result.record.workers
    assert workers.replica_failures == 1
    assert 1 <= len(workers.units_retried) <= 2  # what the dead replica had in flight


def test_replicas_that_keep_dying_fail_naming_the_missing_units_and_a_rerun_resumes(tmp_path, ray_cluster,
                                                                                      tiny_model):
    # One replica: it and its replacements (the bound: ray_driver.MIN_RESTARTS) are all killed.
    job_file = write_job(tmp_path, tiny_model, cluster={"backend": "ray", "replicas": 1}, sampling={"max_tokens": 12})
    out = tmp_path / "out" / "scaled"
    killer = Killer(out, after_commits=1, count=None)
    killer.start()
    failed = CliRunner().invoke(app, ["run", str(job_file), "--no-progress"])
    killer.stop.set()
    killer.join()
    assert failed.exit_code == 1, failed.output
    assert "every replica died" in failed.output and "not committed: part-" in failed.output
    committed = {p.stem for p in (out / "_commits").glob("*.json")}
    named = failed.output.split("not committed: ", 1)[1]
    assert all(f"part-{k:05d}" in named for k in range(NUM_ROWS) if f"part-{k:05d}" not in committed)
    assert not (out / "_SUCCESS").exists()

    rerun = run_job(load_job(job_file), progress=False)
    assert rerun.num_units_skipped == len(committed) and rerun.record.resumed is True
    assert_each_row_once(out)


def test_a_loglikelihood_job_on_two_replicas_gives_the_local_scores(tmp_path, ray_cluster, tiny_model):
    data = write_parquet(tmp_path / "score.parquet", {
        "id": list(range(6)), "prompt": [f"Item {i} is" for i in range(6)],
        "choices": [[" red", " a blue one", " green"]] * 6})

    def score_job(name: str, **sections) -> Path:
        job = {"name": name, "task": "loglikelihood",
               "model": {"path": str(tiny_model), "dtype": "float32", "max_model_len": 128},
               "engine": {"device": "cpu", "kv_cache_memory": "8MiB", "max_num_seqs": 2},
               "input": {"path": str(data), "continuations_column": "choices", "apply_chat_template": False,
                         "rows_per_unit": 2},
               "output": {"path": str(tmp_path / name)}, **sections}
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(job))
        return path

    columns = ["id", "is_greedy", "continuation_token_ids", "prompt_tokens"]
    run_job(load_job(score_job("local")), progress=False)
    result = run_job(load_job(score_job("ray", cluster=RAY)), progress=False)
    ray_rows, local_rows = read_output(tmp_path / "ray"), read_output(tmp_path / "local")
    assert ray_rows.select(columns) == local_rows.select(columns)
    for ours, theirs in zip(ray_rows["continuation_logprob"].to_pylist(), local_rows["continuation_logprob"].to_pylist()):
        assert ours == pytest.approx(theirs, abs=1e-4)
    assert result.record.num_requests == 6 and result.record.workers.backend == "ray"
