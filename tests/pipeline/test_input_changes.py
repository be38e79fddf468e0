"""A resume over a changed input is refused (units would be other rows); an output inside its input is refused."""

from __future__ import annotations

import json
import os
from collections import Counter

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.pipeline.errors import JobError
from batchgen.pipeline.job import run_job
from batchgen.pipeline.job_plan import plan_job
from tests.pipeline.conftest import FailingEngine, FakeEngine, make_job, read_output, write_parquet


def write_input(folder, name: str, ids: list[int], prompt: str = "p") -> None:
    write_parquet(folder / name, {"id": ids, "prompt": [f"{prompt} {i}" for i in ids]})


def add(folder):
    write_input(folder, "c.parquet", [20, 21])
    return "c.parquet was added (2 rows)"


def remove(folder):
    (folder / "b.parquet").unlink()
    return "b.parquet was removed (it had 4 rows)"


def grow(folder):
    write_input(folder, "a.parquet", [0, 1, 2, 3, 4])
    return "a.parquet grew from 4 to 5 rows"


def rewrite(folder):
    stat = (folder / "a.parquet").stat()
    write_input(folder, "a.parquet", [0, 1, 2, 3], prompt="q")  # same rows, other prompts, same size
    os.utime(folder / "a.parquet", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    return "a.parquet was rewritten (same 4 rows"


@pytest.mark.parametrize("change", [add, remove, grow, rewrite], ids=lambda f: f.__name__)
def test_a_changed_input_is_refused_at_resume_and_overwrite_starts_over(tmp_path, change):
    data = tmp_path / "data"
    write_input(data, "a.parquet", [0, 1, 2, 3])
    write_input(data, "b.parquet", [10, 11, 12, 13])
    job = make_job(tmp_path, str(data), engine={"max_num_seqs": 2}, input={"rows_per_unit": 2},
                   batching={"window": 2})
    with pytest.raises(RuntimeError, match="preempted"):
        run_job(job, engine=FailingEngine(job.engine_config()), progress=False)
    assert (tmp_path / "out" / "part-00000.parquet").exists()

    expected = change(data)
    with pytest.raises(JobError) as info:
        run_job(job, engine=FakeEngine(job.engine_config()), progress=False)
    message = str(info.value)
    assert "the input changed since" in message and expected in message and "--overwrite" in message
    assert expected in plan_job(job).state.refusal  # `batchgen validate` says so too

    run_job(job, engine=FakeEngine(job.engine_config()), overwrite=True, progress=False)
    now = [i for f in sorted(data.glob("*.parquet")) for i in pq.read_table(f).column("id").to_pylist()]
    assert Counter(read_output(tmp_path / "out").column("id").to_pylist()) == Counter(now)


def test_the_manifest_records_the_input_fingerprint(tmp_path):
    data = tmp_path / "data"
    write_input(data, "a.parquet", [0, 1, 2])
    job = make_job(tmp_path, str(data))
    run_job(job, engine=FakeEngine(job.engine_config()), progress=False)
    [entry] = json.loads((tmp_path / "out" / "_batchgen.json").read_text())["input"]["files"]
    stat = (data / "a.parquet").stat()
    assert entry == {"path": str(data / "a.parquet"), "size": stat.st_size, "num_rows": 3,
                     "version": f"mtime_ns:{stat.st_mtime_ns}"}
    again = run_job(job, engine=FakeEngine(job.engine_config()), progress=False)  # unchanged: nothing to do
    assert again.num_units_run == 0


def test_a_changed_object_store_input_is_refused(tmp_path):
    fs = fsspec.filesystem("memory")
    with fs.open("/changes-test/in/a.parquet", "wb") as f:
        pq.write_table(pa.table({"id": [1, 2], "prompt": ["x", "y"]}), f)
    job = make_job(tmp_path, "memory://changes-test/in/", input={"rows_per_unit": 1}, engine={"max_num_seqs": 1},
                   output={"path": "memory://changes-test/out"})
    with pytest.raises(RuntimeError, match="preempted"):
        run_job(job, engine=FailingEngine(job.engine_config(), fail_step=1), progress=False)
    with fs.open("/changes-test/in/a.parquet", "wb") as f:  # same size and rows, written again
        pq.write_table(pa.table({"id": [1, 2], "prompt": ["z", "w"]}), f)
    with pytest.raises(JobError, match=r"a.parquet was rewritten \(same 2 rows; same size, created:"):
        run_job(job, engine=FakeEngine(job.engine_config()), progress=False)
    fs.rm("/changes-test", recursive=True)


@pytest.mark.parametrize("layout", ["inside folder", "same folder", "recursive glob", "through a symlink"])
def test_an_output_inside_its_input_is_refused(tmp_path, layout):
    data = tmp_path / "data"
    write_input(data, "a.parquet", [0, 1])
    input_path, output_path = {
        "inside folder": (data, data / "out"),
        "same folder": (data, data),
        "recursive glob": (f"{data}/**/*.parquet", data / "runs" / "out"),
        "through a symlink": (data, tmp_path / "link" / "out"),
    }[layout]
    os.symlink(data, tmp_path / "link")
    job = make_job(tmp_path, str(input_path), output={"path": str(output_path)})
    with pytest.raises(JobError, match="is inside input.path"):
        run_job(job, engine=FakeEngine(job.engine_config()), progress=False)
    assert not list(data.rglob("part-*"))


def test_an_output_beside_a_flat_glob_is_fine(tmp_path):
    data = tmp_path / "data"
    write_input(data, "a.parquet", [0, 1])
    job = make_job(tmp_path, f"{data}/*.parquet", output={"path": str(data / "out")})  # parts never match
    run_job(job, engine=FakeEngine(job.engine_config()), progress=False)
    again = run_job(job, engine=FakeEngine(job.engine_config()), progress=False)
    assert again.record.num_rows == 2
