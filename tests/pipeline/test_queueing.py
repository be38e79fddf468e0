"""Honest queueing: the feeder bounds what the engine holds in sequences (n per request), so with n = 4
queue_s measures the engine's own wait, not the feeder's read-ahead."""

from __future__ import annotations

import statistics

import pyarrow.parquet as pq
import yaml

from batchgen.pipeline.config import load_job
from batchgen.pipeline.job import run_job
from tests.pipeline.conftest import FakeEngine, make_job, read_output, write_parquet

N = 4


class CountingEngine(FakeEngine):
    """A FakeEngine that counts its sequences as the real engine does (n per request) and records the
    most it held."""

    def __init__(self, config):
        super().__init__(config)
        self.max_seqs_held = 0

    @property
    def num_unfinished_seqs(self) -> int:
        return sum(params.n for _, params, _ in self.waiting.values())

    def add_request(self, *args, **kwargs) -> None:
        super().add_request(*args, **kwargs)
        self.max_seqs_held = max(self.max_seqs_held, self.num_unfinished_seqs)


def test_the_engine_holds_max_num_seqs_sequences_not_requests(tmp_path):
    path = write_parquet(tmp_path / "in.parquet", {"id": list(range(40)), "prompt": [f"p{i}" for i in range(40)]})
    job = make_job(tmp_path, str(path), engine={"max_num_seqs": 8},
                   sampling={"n": N, "temperature": 0.5, "seed": 1, "max_tokens": 4})
    engine = CountingEngine(job.engine_config())
    run_job(job, engine=engine, progress=False)
    assert engine.max_seqs_held == 8  # 2 requests of 4 (a request count of 2 x 8 would hold 64)
    assert engine.max_unfinished == 2
    assert read_output(tmp_path / "out").num_rows == 40 * N


def test_with_n_4_queue_time_is_a_small_part_of_the_latency(tmp_path, tiny_model):
    num_rows = 24
    write_parquet(tmp_path / "in.parquet", {"id": list(range(num_rows)),
                                            "prompt": [f"Tell me about {i}." for i in range(num_rows)]})
    job = {"name": "n4", "model": {"path": str(tiny_model), "dtype": "float32", "max_model_len": 128},
           "engine": {"device": "cpu", "kv_cache_memory": "8MiB", "max_num_seqs": 8},
           "input": {"path": str(tmp_path / "in.parquet")},
           "sampling": {"n": N, "temperature": 0.9, "seed": 2, "max_tokens": 32, "ignore_eos": True},
           "output": {"path": str(tmp_path / "out")}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    run_job(load_job(tmp_path / "job.yaml"), progress=False)
    rows = pq.read_table(tmp_path / "out" / "part-00000.parquet", columns=["queue_s", "e2e_s"]).to_pydict()
    assert len(rows["queue_s"]) == num_rows * N
    queue, e2e = statistics.median(rows["queue_s"]), statistics.median(rows["e2e_s"])
    # Before: 2 x max_num_seqs requests (64 sequences for 8 slots) in the engine, queue_s p50 ~ 60% of e2e_s.
    assert queue < 0.1 * e2e, (queue, e2e)
