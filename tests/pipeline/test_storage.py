"""Object stores: memory:// and a local S3 (moto) give identical rows; an interrupted write leaves nothing."""

from __future__ import annotations

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.pipeline.job import run_job
from batchgen.pipeline.storage import Storage
from tests.pipeline.conftest import FakeEngine, make_job

PROMPTS = pa.table({"id": [7, 8, 9], "prompt": ["Name a color.", "Name a fruit.", "Name a tree."]})


def put_parquet(url: str, table: pa.Table, options: dict | None = None) -> None:
    fs, path = fsspec.core.url_to_fs(url, **(options or {}))
    with fs.open(path, "wb") as f:
        pq.write_table(table, f)


def read_remote_output(url: str, options: dict | None = None) -> tuple[list[str], pa.Table]:
    fs, root = fsspec.core.url_to_fs(url, **(options or {}))
    fs.invalidate_cache()
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))
    parts = [n for n in names if n.startswith("part-")]
    tables = []
    for name in parts:
        with fs.open(f"{root.rstrip('/')}/{name}", "rb") as f:
            tables.append(pq.read_table(f))
    return names, pa.concat_tables(tables)


def test_memory_and_s3_give_identical_rows(tmp_path, engine, s3_options):
    put_parquet("memory://storage-test/in/prompts.parquet", PROMPTS)
    put_parquet("s3://batchgen-test/in/prompts.parquet", PROMPTS, s3_options)
    sections = {"input": {"rows_per_unit": 2}, "sampling": {"temperature": 0.7, "seed": 5, "max_tokens": 3}}
    memory_job = make_job(tmp_path, "memory://storage-test/in/", output={"path": "memory://storage-test/out"},
                          **sections)
    s3_job = make_job(tmp_path, "s3://batchgen-test/in/*.parquet",
                      output={"path": "s3://batchgen-test/out", "storage_options": s3_options}, **sections)
    s3_job.input.storage_options = s3_options
    run_job(memory_job, engine=engine, progress=False)
    run_job(s3_job, engine=engine, progress=False)

    memory_names, memory_rows = read_remote_output("memory://storage-test/out")
    s3_names, s3_rows = read_remote_output("s3://batchgen-test/out", s3_options)
    assert memory_names == s3_names == ["_SUCCESS", "_batchgen.json", "_commits", "part-00000.parquet",
                                        "part-00001.parquet"]  # the lock is gone once the run ended
    assert memory_rows.num_rows == 3
    # The second run finds the prompts in the shared engine's prefix cache: cached_tokens and the last
    # float32 bits of the logprobs may differ; what was generated may not.
    exact = ["id", "sample_index", "completion", "completion_token_ids", "finish_reason", "prompt_tokens",
             "completion_tokens", "error"]
    assert memory_rows.select(exact).equals(s3_rows.select(exact))
    assert memory_rows.column("cumulative_logprob").to_pylist() == pytest.approx(
        s3_rows.column("cumulative_logprob").to_pylist(), abs=1e-4)
    fsspec.filesystem("memory").rm("/storage-test", recursive=True)


def half_then_fail(target) -> None:
    """Writes part of a Parquet file, then dies, as a crash in the middle of serialization would."""
    data = pa.BufferOutputStream()
    pq.write_table(pa.table({"x": list(range(1000))}), data)
    blob = data.getvalue().to_pybytes()
    if isinstance(target, str):
        with open(target, "wb") as f:
            f.write(blob[: len(blob) // 2])
    else:
        target.write(blob[: len(blob) // 2])
    raise RuntimeError("interrupted")


@pytest.mark.parametrize("where", ["local", "memory", "s3"])
def test_an_interrupted_write_leaves_no_partial_object(tmp_path, s3_options, where):
    url, options = {"local": (str(tmp_path / "out"), {}), "memory": ("memory://interrupt-test/out", {}),
                    "s3": ("s3://batchgen-test/interrupt-out", s3_options)}[where]
    storage = Storage(url, options)
    storage.write_text_atomic("_batchgen.json", "{}")  # the folder exists: only the unit file is at stake
    with pytest.raises(RuntimeError, match="interrupted"):
        storage.write_atomic("part-00000.parquet", half_then_fail)
    storage.fs.invalidate_cache()
    assert storage.list_names() == ["_batchgen.json"]  # no part file, no temp file


class FailingEngine(FakeEngine):
    """Dies at its third step: after the first unit's file is written, before the job ends."""

    def step(self):
        if self.num_steps == 2:
            raise RuntimeError("node preempted")
        return super().step()


def test_a_job_killed_mid_run_on_memory_leaves_whole_units_and_resumes(tmp_path):
    put_parquet("memory://resume-test/in/prompts.parquet", pa.table({"id": list(range(6)), "prompt": ["p"] * 6}))
    job = make_job(tmp_path, "memory://resume-test/in/", engine={"max_num_seqs": 2}, input={"rows_per_unit": 2},
                   batching={"window": 2}, output={"path": "memory://resume-test/out"})
    with pytest.raises(RuntimeError, match="preempted"):
        run_job(job, engine=FailingEngine(job.engine_config()), progress=False)
    names, rows = read_remote_output("memory://resume-test/out")
    assert "_SUCCESS" not in names and "part-00000.parquet" in names and "part-00002.parquet" not in names
    num_done = len([n for n in names if n.startswith("part-")])
    assert rows.num_rows == 2 * num_done  # whole units only
    result = run_job(job, engine=FakeEngine(job.engine_config()), progress=False)
    names, rows = read_remote_output("memory://resume-test/out")
    assert sorted(rows.column("id").to_pylist()) == list(range(6)) and "_SUCCESS" in names
    assert (result.num_units_skipped, result.num_units_run) == (num_done, 3 - num_done)
    assert result.record.resumed is True
    assert result.record.num_rows == 6
    fsspec.filesystem("memory").rm("/resume-test", recursive=True)
