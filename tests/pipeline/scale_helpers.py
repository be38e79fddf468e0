"""Helpers for the scale-out tests (static shards, Ray): one small job on the tiny model, row comparison."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pyarrow as pa
import yaml

from tests.pipeline.conftest import read_output, write_parquet

NUM_ROWS = 12


def write_job(tmp_path: Path, tiny_model: Path, name: str = "scaled", **sections) -> Path:
    """A job of NUM_ROWS rows, one unit per row: even rows greedy, odd rows seeded sampling (n=2 on
    every row needs temperature > 0, so n stays 1 and the per-row temperature mixes both kinds)."""
    ids = [f"row-{i:02d}" for i in range(NUM_ROWS)]
    data = tmp_path / "data" / "in.parquet"
    if not data.exists():
        write_parquet(data, {"id": ids, "prompt": [f"Tell me about number {i}." for i in range(NUM_ROWS)],
                             "temp": [0.0 if i % 2 == 0 else 0.9 for i in range(NUM_ROWS)]})
    job = {
        "name": name,
        "model": {"path": str(tiny_model), "dtype": "float32", "max_model_len": 128},
        "engine": {"device": "cpu", "kv_cache_memory": "8MiB", "max_num_seqs": 2},
        "input": {"path": str(data), "rows_per_unit": 1},
        "sampling": {"temperature": 0.9, "seed": 7, "max_tokens": 6, "ignore_eos": True},
        "sampling_columns": {"temperature": "temp"},
        "batching": {"window": 1},
        "output": {"path": str(tmp_path / "out" / name)},
    }
    for key, value in sections.items():
        job[key] = {**job.get(key, {}), **value} if isinstance(value, dict) else value
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


# n-gram speculation for the scale-out tests: it changes no output, and at these running batches
# (at most 2, below the default switch) every decode drafts exactly what its own tokens suggest, so a
# job's draft and accepted counts do not depend on where its rows ran either.
NGRAM = {"speculative": {"method": "ngram", "num_speculative_tokens": 2}}


def run_locally(tmp_path: Path, tiny_model: Path, **sections) -> tuple[list[tuple], dict]:
    """The reference for every placement: write_job's job run locally, in this process -> (row_key, _SUCCESS)."""
    from batchgen.pipeline.config import load_job
    from batchgen.pipeline.job import run_job

    result = run_job(load_job(write_job(tmp_path, tiny_model, **sections)), progress=False)
    return row_key(read_output(tmp_path / "out" / "scaled")), result.record.to_dict()


def row_key(table: pa.Table) -> list[tuple]:
    """What must not depend on placement: id, sample index, completion token ids (latency may differ)."""
    return sorted(zip(table.column("id").to_pylist(), table.column("sample_index").to_pylist(),
                      [tuple(t) for t in table.column("completion_token_ids").to_pylist()]))


def assert_each_row_once(folder: Path, num_rows: int = NUM_ROWS) -> pa.Table:
    rows = read_output(folder)
    pairs = Counter(zip(rows.column("id").to_pylist(), rows.column("sample_index").to_pylist()))
    assert pairs == Counter({(f"row-{i:02d}", 0): 1 for i in range(num_rows)})
    return rows
