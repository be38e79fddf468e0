"""The output folder opens in every common reader as docs/reference/output.md#reading-the-output says:
polars, duckdb and `datasets` by the glob `OUT/part-*.parquet` (or `datasets` by the card's configs),
pandas and pyarrow by the folder itself, or by the parts once `batchgen card` put a README.md beside them."""

from __future__ import annotations

import glob
import shutil

import datasets
import pandas as pd
import polars as pl
import pyarrow.parquet as pq
import pytest

from batchgen.pipeline.job import run_job
from batchgen.report.card import write_card
from tests.pipeline.conftest import FakeEngine, make_job, read_output, write_parquet

NUM_ROWS, N = 25, 2


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished output of three parts (n = 2), and the rows they hold in unit order."""
    tmp = tmp_path_factory.mktemp("readers")
    write_parquet(tmp / "in.parquet", {"id": [f"r{i:02d}" for i in range(NUM_ROWS)],
                                       "prompt": [f"Prompt number {i}." for i in range(NUM_ROWS)]})
    job = make_job(tmp, str(tmp / "in.parquet"), input={"rows_per_unit": 10},
                   sampling={"n": N, "temperature": 0.5, "seed": 1, "max_tokens": 4})
    run_job(job, engine=FakeEngine(job.engine_config()), progress=False)
    out = tmp / "out"
    assert {p.name for p in out.iterdir()} >= {"_SUCCESS", "_commits", "_batchgen.json", "part-00002.parquet"}
    return out, tmp, read_output(out)


def keys(ids, samples) -> list[tuple]:
    return list(zip(list(ids), [int(s) for s in samples]))


def expected_keys(expected) -> list[tuple]:
    return keys(expected.column("id").to_pylist(), expected.column("sample_index").to_pylist())


def test_pandas_and_pyarrow_read_the_folder_itself(finished):
    out, _, expected = finished
    assert pq.read_table(out).num_rows == NUM_ROWS * N  # _SUCCESS, _commits/, _batchgen.json skipped
    frame = pd.read_parquet(out)
    assert keys(frame["id"], frame["sample_index"]) == expected_keys(expected)


def test_every_reader_opens_the_parts_beside_a_dataset_card(finished):
    folder, tmp, expected = finished
    out = tmp / "carded"
    shutil.copytree(folder, out)
    write_card(str(out))  # README.md in the folder, where the Hub reads it
    parts = sorted(glob.glob(f"{out}/part-*.parquet"))
    assert len(parts) == 3

    polars = pl.read_parquet(f"{out}/part-*.parquet")
    assert keys(polars["id"], polars["sample_index"]) == expected_keys(expected)
    assert polars["completion"].to_list() == expected.column("completion").to_pylist()

    frame = pd.read_parquet(parts)
    assert keys(frame["id"], frame["sample_index"]) == expected_keys(expected)
    table = pq.read_table(parts)
    assert table.select(["id", "sample_index", "completion"]) == expected.select(["id", "sample_index", "completion"])

    # duckdb is in the test extras; a venv installed before it was added lacks it
    duckdb = pytest.importorskip("duckdb", reason="duckdb is a test extra (pip install -e '.[test]')")
    rows = duckdb.sql(f"SELECT id, sample_index FROM '{out}/part-*.parquet'").fetchall()
    assert sorted(rows) == sorted(expected_keys(expected))

    by_glob = datasets.load_dataset("parquet", data_files=f"{out}/part-*.parquet", split="train",
                                    cache_dir=str(tmp / "hf-cache"))
    assert keys(by_glob["id"], by_glob["sample_index"]) == expected_keys(expected)
    by_card = datasets.load_dataset(str(out), split="train", cache_dir=str(tmp / "hf-cache"))
    assert keys(by_card["id"], by_card["sample_index"]) == expected_keys(expected)
