"""The run record: `_SUCCESS` read back as a RunRecord and written again byte for byte, older records
read with their defaults, and the one summary every view prints."""

from __future__ import annotations

import dataclasses
import json

import pyarrow as pa
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
from batchgen.pipeline.summary import Totals
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
        job="j", config_hash="c" * 64, model="m", num_requests=4, num_rows=8, num_errors=1,
        finish_reasons={"stop": 5, "length": 2, "error": 1}, error_reasons={"overlong prompt: N tokens": 1}, prompt_tokens=200,
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
    assert shown["finish_reasons"] == "stop 5 (62.5%), length 2 (25.0%), error 1 (12.5%)"
    assert shown["error_reasons"] == "1 x overlong prompt: N tokens"
    lines = format_summary(record, "/out/_SUCCESS").splitlines()
    assert lines[-1].split() == ["success", "file", "/out/_SUCCESS"]
    assert [line.split(None, len(row.label.split()))[-1] for line, row in zip(lines, rows)] == [r.text for r in rows]
    assert len({line.index(row.text, 2 + len(row.label)) for line, row in zip(lines, rows)}) == 1  # one column


def test_engine_reports_from_worker_summaries_read_null_parts_as_empty():
    report = EngineReport.from_dict({"model": "m", "kernels": {"device": "cpu"}, "kv_cache": None})
    assert report == EngineReport(model="m", kernels={"device": "cpu"})
    assert EngineReport.from_dict(report.to_dict()) == report


def test_the_summary_lists_the_top_error_reasons_and_warns_of_many_length_rows(tmp_path):
    """Issue 40: the end summary says why requests failed (the five most frequent reasons, numbers
    masked so one cause counts once) and warns when more than a quarter of the rows hit max_tokens."""
    messages = [f"overlong prompt: {300 + i} prompt tokens + max_tokens 16 > max_model_len 256" for i in range(4)]
    messages += ["the prompt has no tokens"] * 3 + [f"reason {chr(97 + i)}" for i in range(5)]
    totals = Totals()
    totals.add_table(pa.table({
        "sample_index": [0] * 16, "finish_reason": ["error"] * 12 + ["length"] * 3 + ["stop"],
        "error": messages + [None] * 4, "prompt_tokens": [1] * 16, "cached_tokens": [0] * 16,
        "completion_tokens": [1] * 16}), with_latency=False)
    record = dataclasses.replace(_full_record(), num_requests=16, num_rows=16, num_errors=12,
                                 finish_reasons=totals.finish_reasons_by_count(),
                                 error_reasons=totals.top_error_reasons())
    assert record.finish_reasons == {"error": 12, "length": 3, "stop": 1}
    assert record.error_reasons == {"overlong prompt: N prompt tokens + max_tokens N > max_model_len N": 4,
                                    "the prompt has no tokens": 3, "reason a": 1, "reason b": 1, "reason c": 1}
    assert RunRecord.from_json(record.to_json()) == record  # most-first order kept through the file
    text = format_summary(record, "/out/_SUCCESS")
    assert "error reasons         4 x overlong prompt: N prompt tokens" in text
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if "4 x overlong" in line)
    assert [line.strip() for line in lines[at + 1:at + 6]] == [
        "3 x the prompt has no tokens", "1 x reason a", "1 x reason b", "1 x reason c", "2 x other reasons"]
    assert "warning" not in text  # 3 of 16 rows hit length: under a quarter

    # Messages quoting each row's own text: the distinct reasons kept are capped, the most frequent stay.
    from batchgen.pipeline import summary

    capped = Totals()
    unique = [f"bad value {chr(97 + i % 26)}{chr(97 + i // 26 % 26)}{chr(97 + i // 676)}"
              for i in range(summary.MAX_DISTINCT_REASONS + 50)]
    capped.add_table(pa.table({
        "sample_index": [0] * (len(unique) + 3), "finish_reason": ["error"] * (len(unique) + 3),
        "error": unique + ["the prompt has no tokens"] * 3, "prompt_tokens": [1] * (len(unique) + 3),
        "cached_tokens": [0] * (len(unique) + 3), "completion_tokens": [0] * (len(unique) + 3)}), with_latency=False)
    assert len(capped.error_reasons) == summary.MAX_DISTINCT_REASONS
    assert next(iter(capped.top_error_reasons().items())) == ("the prompt has no tokens", 3)

    many_length = dataclasses.replace(record, finish_reasons={"length": 5, "stop": 11})
    assert format_summary(many_length, "/out/_SUCCESS").splitlines()[-1].strip().startswith(
        "warning: 5 of 16 rows (31.2%) stopped at max_tokens (finish_reason length)")
    assert "warning" not in format_summary(dataclasses.replace(record, finish_reasons={"length": 4, "stop": 12}), "x")


def test_a_runs_record_counts_finish_and_error_reasons_from_its_rows(tmp_path):
    rows = 6
    path = write_parquet(tmp_path / "in.parquet", {"id": list(range(rows)),
                                                   "prompt": ["p0", "", "p2", "", "p4", "p5"]})
    job = make_job(tmp_path, str(path), input={"rows_per_unit": 2, "apply_chat_template": False})
    result = run_job(job, engine=FakeEngine(job.engine_config()), progress=False)
    success = json.loads((tmp_path / "out" / "_SUCCESS").read_text())
    assert success["num_errors"] == 2 and sum(success["finish_reasons"].values()) == rows
    assert success["finish_reasons"]["error"] == 2
    assert list(success["error_reasons"].values()) == [2] and result.record.error_reasons == success["error_reasons"]
    from batchgen.report.card import write_card

    card = open(write_card(str(tmp_path / "out"), None)).read()
    (reason,) = success["error_reasons"]
    assert f"## Error reasons\n\n| error | requests |\n|---|---|\n| {reason} | 2 |" in card
