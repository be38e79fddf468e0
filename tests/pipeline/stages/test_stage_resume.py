"""Per-stage resume across a crash: `batchgen run` of a three-stage job SIGKILLed during stage 2, then run
again: stage 1's files are untouched (bytes and mtimes), stage 2 finishes only its missing units, and every
stage's output equals an uninterrupted run's. Changing only stage 3's min_margin then reruns stage 3 alone.

Only the killed run is a child process (kill -9 needs one); the uninterrupted run and the reruns call
run_staged_job in this process, as `batchgen run` does (each child costs ~10 s of interpreter and torch
start on the 2-core machine)."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from batchgen.pipeline.stages import load_any_job
from batchgen.pipeline.stages.run import run_staged_job
from tests.pipeline.cli_process import batchgen, part_files, sigkill_after_first_part
from tests.pipeline.conftest import read_output, write_parquet

LOCK_NAME = "_batchgen.lock"
NUM_PROMPTS, N = 4, 2
# the columns that do not depend on timing (queue_s, ttft_s, ... do)
SAMPLE_COLUMNS = ["id", "sample_index", "completion", "completion_token_ids", "finish_reason"]
PAIR_COLUMNS = ["id", "prompt", "chosen", "rejected", "chosen_score", "rejected_score"]


def _job_file(tmp_path: Path, tiny_model: Path, out: Path) -> str:
    write_parquet(tmp_path / "prompts.parquet", {
        "id": [f"p{i}" for i in range(NUM_PROMPTS)],
        "messages": [[{"role": "user", "content": f"Question {i}?"}] for i in range(NUM_PROMPTS)]})
    job = {"name": "crash", "output": {"path": str(out)},
           "model": {"path": str(tiny_model), "dtype": "float32", "max_model_len": 128},
           # two sequences at a time, a unit per row: stage 2's units finish far enough apart to kill between
           "engine": {"device": "cpu", "kv_cache_memory": "8MiB", "max_num_seqs": 2},
           "batching": {"window": 1},
           "sampling": {"temperature": 0.9, "seed": 3, "max_tokens": 6, "ignore_eos": True},
           "stages": [
               {"name": "gen", "input": {"path": str(tmp_path / "prompts.parquet"), "messages_column": "messages"},
                "sampling": {"n": N}},
               {"name": "score", "input": {"stage": "gen", "prompt_template": "Rate: {{ completion }}",
                                           "rows_per_unit": 1}},
               {"name": "pairs", "task": "select", "input": {"stage": "score"},
                "select": {"rule": "dpo_pairs", "score_column": "cumulative_logprob",
                           "completion_column": "gen_completion"}}]}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return str(path)


def _run(job: str, *overrides: str) -> dict:
    """The job run to completion in this process: {stage name: StageResult}."""
    return {r.stage.name: r for r in run_staged_job(load_any_job(job, list(overrides)), progress=False)}


def _files(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under a stage's folder (parts, commit records, _SUCCESS, manifest): its bytes and mtime;
    not the lock, which every run takes, even of a complete folder."""
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != LOCK_NAME}


def _rows(folder: Path, columns: list[str]) -> list[dict]:
    return sorted(read_output(folder).select(columns).to_pylist(), key=lambda r: (r["id"], r.get("sample_index", 0),
                                                                                  str(r.get("completion"))))


@pytest.mark.subprocess
def test_sigkill_in_stage_2_resumes_there_and_ends_as_an_uninterrupted_run(tmp_path, tiny_model):
    reference = tmp_path / "reference"
    _run(_job_file(tmp_path / "a", tiny_model, reference))

    out = tmp_path / "out"
    job = _job_file(tmp_path / "b", tiny_model, out)
    done_before = sigkill_after_first_part(batchgen("run", job, "--no-progress"), out / "score")
    assert done_before and len(done_before) < NUM_PROMPTS * N and not (out / "score" / "_SUCCESS").exists()
    assert (out / "gen" / "_SUCCESS").exists() and not (out / "pairs").exists()
    gen_files = _files(out / "gen")

    rerun = _run(job)
    assert _files(out / "gen") == gen_files  # stage 1: not a byte, not an mtime changed
    assert (rerun["gen"].num_units_run, rerun["gen"].num_units_skipped) == (0, 1)
    assert rerun["score"].num_units_skipped == len(done_before)  # its finished units skipped, the rest run
    assert rerun["score"].num_units_run == NUM_PROMPTS * N - len(done_before)
    after = part_files(out / "score")
    assert {name: after[name] for name in done_before} == done_before  # stage 2's finished units kept
    assert len(after) == NUM_PROMPTS * N

    assert _rows(out / "gen", SAMPLE_COLUMNS) == _rows(reference / "gen", SAMPLE_COLUMNS)
    assert _rows(out / "score", SAMPLE_COLUMNS) == _rows(reference / "score", SAMPLE_COLUMNS)
    pairs = pq.read_table(out / "pairs" / "part-00000.parquet").select(PAIR_COLUMNS).to_pylist()
    expected = pq.read_table(reference / "pairs" / "part-00000.parquet").select(PAIR_COLUMNS).to_pylist()
    # the same pairs of the same texts; the log-probabilities that rank them agree to float32 rounding (the
    # resumed run batches stage 2's rows otherwise, and a float32 matmul's sums depend on the batch's shape)
    assert [(p["id"], p["prompt"], p["chosen"], p["rejected"]) for p in pairs] == [
        (p["id"], p["prompt"], p["chosen"], p["rejected"]) for p in expected]
    for got, want in zip(pairs, expected):
        assert got["chosen_score"] == pytest.approx(want["chosen_score"], rel=1e-5)
        assert got["rejected_score"] == pytest.approx(want["rejected_score"], rel=1e-5)
    assert pairs  # random-weight samples: distinct log-probabilities, so pairs there are

    # only stage 3's min_margin changes: stages 1 and 2 are complete and kept, stage 3 is made again
    before = {name: _files(out / name) for name in ("gen", "score")}
    margin = abs(pairs[0]["chosen_score"] - pairs[0]["rejected_score"]) + 1e-3  # drops at least that pair
    changed = _run(job, f"stages.pairs.select.min_margin={margin}")
    assert {name: _files(out / name) for name in ("gen", "score")} == before
    assert [changed[name].num_units_run for name in ("gen", "score", "pairs")] == [0, 0, 1]
    margins = [p["chosen_score"] - p["rejected_score"] for p in pq.read_table(
        out / "pairs" / "part-00000.parquet").to_pylist()]
    assert len(margins) < len(pairs) and all(m >= margin for m in margins)
