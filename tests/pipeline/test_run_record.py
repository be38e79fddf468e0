"""The run record: `_SUCCESS` read back as a RunRecord and written again byte for byte, older records
read with their defaults, and the one summary every view prints."""

from __future__ import annotations

import json

import pytest

from batchgen.pipeline.job import run_job
from batchgen.pipeline.run_record import (
    EngineReport,
    GenerationDefaults,
    MetricFigures,
    Percentiles,
    RecordError,
    ReplicaPlacement,
    RunRecord,
    SpeculativeFigures,
    StructuredFigures,
    Workers,
)
from batchgen.pipeline.run_record_text import format_summary, summary_rows
from batchgen.pipeline.shards import ShardSpec, run_shard
from tests.pipeline.conftest import FakeEngine, make_job, write_parquet

# The keys of the first batchgen's _SUCCESS (design.md): every record has them.
FIRST_KEYS = ("job", "config_hash", "num_requests", "num_rows", "num_errors", "prompt_tokens", "cached_tokens",
              "completion_tokens", "generation_seconds", "completion_tokens_per_s", "ttft_s", "tpot_s", "resumed")


def _job(tmp_path, rows: int = 7):
    path = write_parquet(tmp_path / "in.parquet", {"id": list(range(rows)), "prompt": [f"p{i}" for i in range(rows)]})
    return make_job(tmp_path, str(path), input={"rows_per_unit": 2})


def test_a_runs_success_reads_back_and_writes_the_same_bytes(tmp_path):
    job = _job(tmp_path)
    result = run_job(job, engine=FakeEngine(job.engine_config()), progress=False)
    text = (tmp_path / "out" / "_SUCCESS").read_text()
    record = RunRecord.from_json(text)
    assert record == result.record and record.to_json() == text
    assert record.num_rows == 7 and record.workers == Workers.local() and record.speculative is None
    assert record.kernels == {"attention_backend": "fake"} and record.generation_config.setting == "vllm"
    assert record.ttft_s.p50 is not None and record.ttft_s.p50 <= record.ttft_s.p99


def test_a_sharded_success_reads_back_and_writes_the_same_bytes(tmp_path):
    job = _job(tmp_path)
    for index in (1, 0):
        done = run_shard(job, ShardSpec(index, 2, "--shard"), engine=FakeEngine(job.engine_config()), progress=False)
    text = (tmp_path / "out" / "_SUCCESS").read_text()
    record = RunRecord.from_json(text)
    assert record == done.finalized.record and record.to_json() == text
    workers = record.workers
    assert (workers.backend, workers.num_shards, workers.num_workers) == ("shards", 2, 2)
    assert [s.index for s in workers.shards] == [0, 1] and workers.replicas is None
    keys = list(json.loads(text)["workers"])  # a shard's keys only, in the order they were always written
    assert keys == ["backend", "num_shards", "num_workers", "replica_failures", "units_retried", "shards"]


def _full_record() -> RunRecord:
    """Every nested part filled, with the Ray backend's workers."""
    return RunRecord(
        job="j", config_hash="c" * 64, model="m", num_requests=4, num_rows=8, num_errors=1, prompt_tokens=200,
        cached_tokens=50, completion_tokens=1234, generation_seconds=2, completion_tokens_per_s=617.0,
        ttft_s=Percentiles(p50=0.0123, p90=0.0456, p99=1.5), tpot_s=Percentiles(), resumed=True,
        generation_config=GenerationDefaults(setting="auto", file="/m/generation_config.json",
                                             applied={"top_k": 5}),
        kernels={"device": "cpu"}, kv_cache={"dtype": "float32", "bytes_per_token": 8},
        weights={"format": "int8", "origin": "quantized at load", "linear_bytes": 2_500_000,
                 "linear_bytes_vs_float32": 0.25},
        workers=Workers(backend="ray", num_workers=2, gpus_per_replica=0.0, replica_failures=1,
                        units_retried=["part-00001.parquet"],
                        replicas=[ReplicaPlacement(host="a", pid=1), ReplicaPlacement(host="b", pid=2)]),
        speculative=SpeculativeFigures.of_counts(10, 6, 4),
        structured=StructuredFigures.of_counts({"num_constrained_requests": 3, "num_masked_steps": 4,
                                                "num_masked_rows": 6, "mask_seconds": 0.002, "num_compiles": 1,
                                                "compile_seconds": 0.5}),
        metrics={"acc": MetricFigures(value=0.625, stderr=0.05, n=40),
                 "none_scored": MetricFigures(value=None, stderr=None, n=0)})


def test_every_part_round_trips_and_keeps_its_values_as_written():
    record = _full_record()
    data = json.loads(record.to_json())
    assert RunRecord.from_dict(data) == record and RunRecord.from_dict(data).to_dict() == data
    assert data["generation_seconds"] == 2 and isinstance(data["generation_seconds"], int)  # not made 2.0
    assert list(data["workers"]) == ["backend", "num_workers", "gpus_per_replica", "replica_failures",
                                     "units_retried", "replicas"]
    assert data["speculative"]["acceptance_rate"] == 0.6 and data["speculative"]["mean_accepted_length"] == 2.5
    assert data["structured"]["mask_ms_per_step"] == pytest.approx(0.5)
    assert data["metrics"]["acc"] == {"value": 0.625, "stderr": 0.05, "n": 40}


def test_a_record_of_the_first_batchgen_still_reads():
    """The 13 keys the first _SUCCESS had: the keys added since read as their defaults."""
    first = {key: _full_record().to_dict()[key] for key in FIRST_KEYS}
    record = RunRecord.from_dict(first)
    assert record.model is None and record.generation_config is None and record.workers is None
    assert (record.kernels, record.kv_cache, record.weights) == ({}, {}, {})
    assert record.speculative is None and record.structured is None and record.num_rows == 8
    shown = {row.key: row.text for row in summary_rows(record)}
    assert shown["workers"] == shown["kernels"] == shown["model"] == "-" and shown["speculative"] == "off"


def test_a_record_without_a_required_key_is_refused_naming_it():
    data = _full_record().to_dict()
    del data["num_rows"], data["ttft_s"]
    with pytest.raises(RecordError, match="_SUCCESS has no num_rows, ttft_s"):
        RunRecord.from_dict(data)
    for key in set(FIRST_KEYS) - {"ttft_s"}:  # each of the first keys is required
        with pytest.raises(RecordError, match=f"has no {key}$"):
            RunRecord.from_dict({k: v for k, v in _full_record().to_dict().items() if k != key})
    with pytest.raises(RecordError, match="speculative has no num_verifies"):
        RunRecord.from_dict({**_full_record().to_dict(), "speculative": {"num_draft_tokens": 1, "num_accepted_tokens": 1}})
    with pytest.raises(RecordError, match="ttft_s is not a JSON object"):
        RunRecord.from_dict({**_full_record().to_dict(), "ttft_s": None})
    with pytest.raises(RecordError, match="not a JSON object"):
        RunRecord.from_json("[1, 2]")
    with pytest.raises(RecordError, match="not JSON"):
        RunRecord.from_json("{")


def test_keys_a_later_version_adds_are_ignored():
    data = {**_full_record().to_dict(), "rewards": {"rm": {"mean": 1.0}}}
    assert RunRecord.from_dict(data) == _full_record()


def test_the_summary_shows_every_key_once_in_the_files_order():
    record = _full_record()
    rows = summary_rows(record)
    assert [row.key for row in rows] == list(record.to_dict())
    shown = {row.key: row.text for row in rows}
    assert shown["num_requests"] == "4" and shown["completion_tokens"] == "1,234"
    assert shown["cached_tokens"] == "50 (25% of prompt tokens)"
    assert shown["generation_seconds"] == "2.00 s" and shown["completion_tokens_per_s"] == "617.0"
    assert shown["ttft_s"] == "12.3 / 45.6 / 1,500.0 ms" and shown["tpot_s"] == "-"
    assert shown["generation_config"] == "top_k=5 from /m/generation_config.json (generation_config auto); the rest the job's"
    assert shown["weights"] == "int8 (quantized at load), linear layers 2.5 MB (25.0% of float32)"
    assert shown["workers"] == "ray, 2 replica(s); 1 replica failure(s), 1 unit(s) retried"
    assert shown["speculative"] == "6 of 10 draft tokens accepted (60%), 2.50 tokens per verify"
    assert shown["structured"] == "3 constrained requests; token mask 0.50 ms per step (1.5 rows)"
    assert shown["metrics"] == "acc 0.6250 (95% CI 0.5270 to 0.7230, n 40); none_scored - (n 0)"
    lines = format_summary(record, "/out/_SUCCESS").splitlines()
    assert lines[-1].split() == ["success", "file", "/out/_SUCCESS"]
    assert [line.split(None, len(row.label.split()))[-1] for line, row in zip(lines, rows)] == [r.text for r in rows]
    assert len({line.index(row.text, 2 + len(row.label)) for line, row in zip(lines, rows)}) == 1  # one column


def test_engine_reports_from_worker_summaries_read_null_parts_as_empty():
    report = EngineReport.from_dict({"model": "m", "kernels": {"device": "cpu"}, "kv_cache": None})
    assert report == EngineReport(model="m", kernels={"device": "cpu"})
    assert EngineReport.from_dict(report.to_dict()) == report
