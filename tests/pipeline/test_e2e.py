"""End to end on the bundled model: chat prompts in, the engine's own completions out, latencies, _SUCCESS."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from batchgen.engine import SamplingParams
from batchgen.pipeline.config import load_job
from batchgen.pipeline.job import run_job
from batchgen.pipeline.job_plan import plan_job
from batchgen.pipeline.run_record import RunRecord
from tests.pipeline.conftest import engine_sections, make_job, read_output, write_parquet

# design.md's _SUCCESS keys and those added since, in the file's order (users read them: they do not change).
SUCCESS_KEYS = ("job", "config_hash", "model", "generation_config", "num_requests", "num_rows", "num_errors",
                "finish_reasons", "error_reasons", "prompt_tokens", "cached_tokens", "completion_tokens", "generation_seconds", "completion_tokens_per_s",
                "ttft_s", "tpot_s", "resumed", "kernels", "kv_cache", "weights", "workers", "speculative", "structured",
                "metrics", "provenance")

REPO = Path(__file__).resolve().parents[2]
CHAT_PROMPTS = REPO / "jobs" / "data" / "chat_prompts.parquet"
EXAMPLE_JOBS = ["quickstart", "sft_synthesis", "dpo_pairs", "nightly_eval", "multiple_choice"]


def engine_alone(engine, requests: list[tuple[str, list[dict]]], params: SamplingParams) -> dict:
    """The engine driven directly, every request at once: {(request id, sample index): CompletionOutput}."""
    for request_id, messages in requests:
        engine.add_request(request_id, messages, params)
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            for c in out.outputs:
                outputs[(out.request_id, c.index)] = (out, c)
    return outputs


def test_chat_job_matches_the_engine_with_consistent_latencies(tmp_path, engine):
    chat = pq.read_table(CHAT_PROMPTS).take([0, 12, 13, 41, 44])  # two share a system prompt; multi-turn ones
    path = write_parquet(tmp_path / "chat.parquet", chat)
    job = make_job(tmp_path, str(path), input={"prompt_column": None, "messages_column": "messages",
                                                "rows_per_unit": 2},
                   sampling={"temperature": 0.8, "n": 2, "seed": 11, "max_tokens": 4, "logprobs": True},
                   output={"path": str(tmp_path / "out"), "keep_columns": ["category"]})
    result = run_job(job, engine=engine, progress=False)

    out = read_output(tmp_path / "out")
    ids = chat.column("id").to_pylist()
    # One row per (request, sample), files in unit order, rows in input order within each file.
    assert [p.name for p in sorted((tmp_path / "out").glob("part-*"))] == [
        "part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    assert list(zip(out.column("id").to_pylist(), out.column("sample_index").to_pylist())) == \
        [(i, s) for i in ids for s in (0, 1)]
    assert out.column("category").to_pylist() == [c for c in chat.column("category").to_pylist() for _ in (0, 1)]
    assert out.column_names[:16] == ["id", "sample_index", "completion", "completion_token_ids", "finish_reason",
                                     "prompt_tokens", "cached_tokens", "completion_tokens", "cumulative_logprob",
                                     "token_logprobs", "queue_s", "ttft_s", "tpot_s", "e2e_s", "num_accepted_tokens",
                                     "error"]

    # Completions equal the engine's own for the same settings and request ids (= row ids).
    params = SamplingParams(n=2, temperature=0.8, seed=11, max_tokens=4, logprobs=True)
    reference = engine_alone(engine, [(str(i), m) for i, m in zip(ids, chat.column("messages").to_pylist())], params)
    rows = out.to_pylist()
    for row in rows:
        ref_out, ref = reference[(str(row["id"]), row["sample_index"])]
        assert row["completion"] == ref.text and row["completion_token_ids"] == ref.token_ids
        assert row["finish_reason"] == ref.finish_reason and row["prompt_tokens"] == len(ref_out.prompt_token_ids)
        assert row["completion_tokens"] == len(ref.token_ids)
        assert row["cumulative_logprob"] == pytest.approx(ref.cumulative_logprob, abs=1e-4)
        assert row["token_logprobs"] == pytest.approx(ref.logprobs, abs=1e-4)
        assert row["error"] is None

    # Latency columns: filled and consistent with the design's definitions.
    for row in rows:
        assert 0 <= row["queue_s"] <= row["ttft_s"] <= row["e2e_s"]
        if row["completion_tokens"] < 2:
            assert row["tpot_s"] is None
        else:
            assert row["tpot_s"] == pytest.approx((row["e2e_s"] - row["ttft_s"]) / (row["completion_tokens"] - 1))
    for i in ids:  # cached_tokens is the request's, repeated on its n rows
        assert len({r["cached_tokens"] for r in rows if r["id"] == i}) == 1

    # _SUCCESS: exactly the design's keys, figures consistent with the rows.
    success = json.loads((tmp_path / "out" / "_SUCCESS").read_text())
    assert tuple(success) == SUCCESS_KEYS and success == result.record.to_dict()
    assert (tmp_path / "out" / "_SUCCESS").read_text() == RunRecord.from_dict(success).to_json()  # byte for byte
    first = [r for r in rows if r["sample_index"] == 0]
    assert success["job"] == "test-job" and success["config_hash"] == job.config_hash()
    assert success["model"] == job.model.path == engine.config.model  # the model the engine loaded
    assert (success["num_requests"], success["num_rows"], success["num_errors"]) == (5, 10, 0)
    assert success["finish_reasons"] == dict(Counter(r["finish_reason"] for r in rows).most_common())
    assert success["error_reasons"] == {}
    assert success["prompt_tokens"] == sum(r["prompt_tokens"] for r in first)
    assert success["cached_tokens"] == sum(r["cached_tokens"] for r in first)
    assert success["completion_tokens"] == sum(r["completion_tokens"] for r in rows)
    assert max(r["e2e_s"] for r in rows) <= success["generation_seconds"]
    assert success["completion_tokens_per_s"] == pytest.approx(
        success["completion_tokens"] / success["generation_seconds"])
    ttft = [r["ttft_s"] for r in rows]
    assert success["ttft_s"]["p50"] == pytest.approx(float(np.percentile(ttft, 50)))
    assert success["ttft_s"]["p99"] == pytest.approx(float(np.percentile(ttft, 99)))
    tpot = [r["tpot_s"] for r in rows if r["tpot_s"] is not None]
    assert success["tpot_s"]["p90"] == pytest.approx(float(np.percentile(tpot, 90)))
    assert success["resumed"] is False
    # The kernels this run's engine used, as its stats report them.
    assert success["kernels"] == engine.stats["kernels"] == engine.capabilities.as_dict()
    assert success["kernels"]["attention_backend"] == "cpu" and success["kernels"]["device"] == "cpu"
    num_tokens = engine.num_kv_blocks * engine.config.block_size
    assert success["kv_cache"] == engine.stats["kv_cache"] == {
        "dtype": "float32", "bytes_per_token": 4 * 2 * 30 * 3 * 64, "num_tokens": num_tokens,
        "bytes": num_tokens * 4 * 2 * 30 * 3 * 64}  # a set kv_cache_memory: no `sizing` from the job


@pytest.mark.parametrize("name", EXAMPLE_JOBS)
def test_example_jobs_validate_and_run(tmp_path, engine, name):
    """Each example job as committed validates; it runs on the shared engine (its settings via --set)."""
    job_file = REPO / "jobs" / f"{name}.yaml"
    plan = plan_job(load_job(job_file))
    assert plan.units and not plan.state.refusal
    sections = engine_sections()
    overrides = [f"{section}.{key}={value}" for section in ("model", "engine") for key, value in sections[section].items()]
    # Per-row budgets (nightly_eval) off too: this test is about the jobs' other keys.
    job = load_job(job_file, [*overrides, f"output.path={tmp_path / 'out'}", "sampling.max_tokens=2",
                              "sampling_columns={}"])
    result = run_job(job, engine=engine, limit=1, progress=False)
    out = read_output(tmp_path / "out")
    assert out.num_rows == job.sampling.n == result.record.num_rows
    assert out.column("error").null_count == out.num_rows
    assert ("token_logprobs" in out.column_names) == job.sampling.logprobs
    for kept in job.output.keep_columns:
        assert kept in out.column_names
