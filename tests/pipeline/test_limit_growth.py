"""Trials that grow: a `--limit` run is extended by a larger --limit, then by the full job, without
generating any of its rows again; the grown output equals one full run's (issue 40)."""

from __future__ import annotations

from collections import Counter

import pyarrow as pa
import pytest

from batchgen.engine import LLMEngine
from batchgen.pipeline.config import load_job
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.job import run_job
from batchgen.pipeline.output import CHECKPOINTS_DIR
from tests.pipeline.conftest import read_output, write_parquet

NUM_ROWS, N, ROWS_PER_UNIT = 400, 2, 250
# Columns that must not depend on which run generated a row (latency and cache hits measure the run).
EXACT = ["id", "sample_index", "completion", "completion_token_ids", "finish_reason", "prompt_tokens",
         "completion_tokens", "error"]


def _job_file(tmp_path, tiny_model, name: str):
    import yaml

    data = tmp_path / "data" / "in.parquet"
    if not data.exists():
        write_parquet(data, {"id": [f"q{i:04d}" for i in range(NUM_ROWS)],
                             "prompt": [f"Question {i}? " + "x" * (i * 7 % 11) for i in range(NUM_ROWS)]})
    job = {"name": "grow", "model": {"path": str(tiny_model), "dtype": "float32", "max_model_len": 64},
           "engine": {"device": "cpu", "kv_cache_memory": "8MiB", "max_num_seqs": 32},
           "input": {"path": str(data), "rows_per_unit": ROWS_PER_UNIT},
           "sampling": {"n": N, "temperature": 0.9, "seed": 3, "max_tokens": 2, "ignore_eos": True},
           "output": {"path": str(tmp_path / name)}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


@pytest.fixture(scope="module")
def tiny_engine(tiny_model, tmp_path_factory):
    job = load_job(_job_file(tmp_path_factory.mktemp("engine"), tiny_model, "probe"))
    return LLMEngine(job.engine_config())


def _run(job_file, engine, limit=None):
    result = run_job(load_job(job_file), engine=engine, limit=limit, progress=False)
    return result.num_rows_generated, result.num_rows_reused


def _rows(folder) -> pa.Table:
    return read_output(folder).select(EXACT)


def test_limit_100_then_300_then_full_generates_each_row_once(tmp_path, tiny_model, tiny_engine):
    grown = _job_file(tmp_path, tiny_model, "grown")
    # 100 rows: unit 0 cut at row 100 (its part holds rows 0-99).
    assert _run(grown, tiny_engine, limit=100) == (100 * N, 0)
    assert read_output(tmp_path / "grown").num_rows == 100 * N
    # 300 rows: unit 0 whole (rows 0-99 reused from the first run's part), unit 1 cut at row 300.
    assert _run(grown, tiny_engine, limit=300) == (200 * N, 100 * N)
    assert read_output(tmp_path / "grown").num_rows == 300 * N
    # The full job: unit 1's 50 rows reused, the rest generated.
    assert _run(grown, tiny_engine) == ((NUM_ROWS - 300) * N, 50 * N)
    assert not (tmp_path / "grown" / CHECKPOINTS_DIR).exists()

    whole = _job_file(tmp_path, tiny_model, "whole")
    assert _run(whole, tiny_engine) == (NUM_ROWS * N, 0)
    rows = _rows(tmp_path / "grown")
    assert Counter(zip(rows.column("id").to_pylist(), rows.column("sample_index").to_pylist())) == Counter(
        {(f"q{i:04d}", s): 1 for i in range(NUM_ROWS) for s in range(N)})
    assert rows.equals(_rows(tmp_path / "whole"))
    # A complete folder is complete for the full job: nothing runs again.
    assert _run(grown, tiny_engine) == (0, 0)


def test_a_smaller_limit_than_the_folder_holds_is_refused(tmp_path, tiny_model, tiny_engine):
    """A run over fewer rows than the folder holds would replace a whole unit by a shorter one: refused."""
    job_file = _job_file(tmp_path, tiny_model, "out")
    _run(job_file, tiny_engine, limit=300)
    before = _rows(tmp_path / "out")
    for limit in (100, 260):  # inside unit 0 (its whole part would shrink); inside unit 1 (cut shorter)
        with pytest.raises(JobError, match="more input rows"):
            _run(job_file, tiny_engine, limit=limit)
    assert _rows(tmp_path / "out").equals(before)
    assert _run(job_file, tiny_engine, limit=300) == (0, 0)  # the same limit: complete
