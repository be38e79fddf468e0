"""A part counts as done only with a matching commit record: damaged or foreign parts are run again."""

from __future__ import annotations

import hashlib
import json
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.pipeline.errors import JobError
from batchgen.pipeline.job import run_job
from batchgen.pipeline.output.commits import IdChecksum
from tests.pipeline.conftest import FakeEngine, make_job, read_output, write_parquet

IDS = list(range(6))


def finished_job(tmp_path):
    path = write_parquet(tmp_path / "in.parquet", {"id": IDS, "prompt": [f"p{i}" for i in IDS]})
    job = make_job(tmp_path, str(path), input={"rows_per_unit": 2})
    run_job(job, engine=FakeEngine(job.engine_config()), progress=False)
    return job, tmp_path / "out"


def empty(out):
    (out / "part-00001.parquet").write_bytes(b"")
    return "size 0 bytes"


def truncated(out):
    part = out / "part-00001.parquet"
    part.write_bytes(part.read_bytes()[:-20])
    return "bytes, its commit record says"


def foreign(out):
    # Another table under the same name: duplicates of units 0 and 2 (what the case accepted).
    table = pq.read_table(out / "part-00000.parquet")
    pq.write_table(pa.concat_tables([table, pq.read_table(out / "part-00002.parquet")]), out / "part-00001.parquet")
    return "its commit record says"


def same_size_other_content(out):
    part = out / "part-00001.parquet"
    blob = bytearray(part.read_bytes())
    blob[8] ^= 0xFF  # a flipped byte inside the first page
    part.write_bytes(bytes(blob))
    return "content differs from its commit record (sha256)"


def no_record(out):
    (out / "_commits" / "part-00001.json").unlink()
    return "no commit record"


def wrong_record(out):
    record = json.loads((out / "_commits" / "part-00001.json").read_text())
    (out / "_commits" / "part-00001.json").write_text(json.dumps({**record, "num_rows": 99}))
    return "its footer says 2 rows, its commit record 99"


@pytest.mark.parametrize("damage", [empty, truncated, foreign, same_size_other_content, no_record, wrong_record],
                         ids=lambda f: f.__name__)
def test_an_untrusted_part_is_run_again_and_said_so(tmp_path, damage, caplog):
    job, out = finished_job(tmp_path)
    why = damage(out)
    result = run_job(job, engine=FakeEngine(job.engine_config()), progress=False)  # _SUCCESS was there
    assert list(result.redone) == ["part-00001.parquet"] and why in result.redone["part-00001.parquet"]
    assert (result.num_units_run, result.num_units_skipped) == (1, 2)
    assert "failed verification and will be run again: part-00001.parquet" in caplog.text
    assert read_output(out).column("id").to_pylist() == IDS  # each row exactly once
    assert result.record.num_rows == len(IDS)
    again = run_job(job, engine=FakeEngine(job.engine_config()), progress=False)
    assert again.num_units_run == 0 and not again.redone


def test_a_part_the_plan_does_not_know_is_refused(tmp_path):
    job, out = finished_job(tmp_path)
    (out / "part-00099.parquet").write_bytes((out / "part-00000.parquet").read_bytes())
    with pytest.raises(JobError, match=r"holds unit files this job does not plan \(part-00099.parquet\)"):
        run_job(job, engine=FakeEngine(job.engine_config()), progress=False)


def test_the_commit_record_describes_its_part(tmp_path):
    job, out = finished_job(tmp_path)
    record = json.loads((out / "_commits" / "part-00002.json").read_text())
    part = out / "part-00002.parquet"
    checksum = IdChecksum()
    checksum.update(pq.read_table(part).column("id"))
    assert record["num_rows"] == 2 and (record["start"], record["stop"], record["unit"]) == (4, 6, 2)
    assert record["sha256"] == hashlib.sha256(part.read_bytes()).hexdigest()
    assert record["size"] == part.stat().st_size and record["id_checksum"] == checksum.hexdigest()
    assert record["config_hash"] == job.config_hash() and record["etag"] is None


def test_a_rewritten_part_on_s3_is_run_again(tmp_path, s3_options):
    import fsspec

    url = "s3://batchgen-test/commits-out"
    path = write_parquet(tmp_path / "in.parquet", {"id": IDS, "prompt": [f"p{i}" for i in IDS]})
    job = make_job(tmp_path, str(path), input={"rows_per_unit": 2},
                   output={"path": url, "storage_options": s3_options})
    run_job(job, engine=FakeEngine(job.engine_config()), progress=False)
    fs = fsspec.filesystem("s3", **s3_options)
    record = json.loads(fs.cat_file("batchgen-test/commits-out/_commits/part-00000.json"))
    assert record["etag"].startswith("ETag:")  # S3 verifies by ETag: no download at resume
    other = fs.cat_file("batchgen-test/commits-out/part-00002.parquet")
    fs.pipe_file("batchgen-test/commits-out/part-00000.parquet", other)  # a foreign part under a known name
    fs.invalidate_cache()
    result = run_job(job, engine=FakeEngine(job.engine_config()), progress=False)
    assert list(result.redone) == ["part-00000.parquet"]
    ids = []
    for i in range(3):
        with fs.open(f"batchgen-test/commits-out/part-{i:05d}.parquet", "rb") as f:
            ids += pq.read_table(f).column("id").to_pylist()
    assert Counter(ids) == Counter(IDS)
    fs.rm("batchgen-test/commits-out", recursive=True)
