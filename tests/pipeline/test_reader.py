"""Reading: pyarrow and polars files alike, row ranges across row groups, listing, units, row decoding."""

from __future__ import annotations

import fsspec
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.pipeline.output.units import contiguous_runs, plan_units
from batchgen.pipeline.parquet_rows import decode_batch
from batchgen.pipeline.reader import inspect_file, list_input_files, read_rows
from batchgen.pipeline.schema import check_input_schema
from batchgen.pipeline.storage import Storage
from tests.pipeline.conftest import make_job, write_parquet

MESSAGES = [[{"role": "user", "content": "hi"}], [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]]


def decoded(tmp_path, path, **sections):
    job = make_job(tmp_path, str(path), **sections)
    storage = Storage(job.input.path)
    file = inspect_file(storage, list_input_files(storage)[0])
    check_input_schema(file, job)
    columns = list(dict.fromkeys([job.input.id_column, job.input.text_column, *job.sampling_columns.values()]))
    return [row for batch in read_rows(storage, file, 0, file.num_rows, columns) for row in decode_batch(batch, job)]


def test_pyarrow_and_polars_files_read_alike(tmp_path):
    """polars writes large_string and large_list; the rows must come out the same as pyarrow's."""
    struct = pa.struct([("role", pa.string()), ("content", pa.string())])
    write_parquet(tmp_path / "pa.parquet", {"id": [1, 2], "messages": pa.array(MESSAGES, pa.list_(struct))})
    pl.DataFrame({"id": [1, 2], "messages": MESSAGES}).write_parquet(tmp_path / "pl.parquet")
    assert pa.types.is_large_list(pq.read_schema(tmp_path / "pl.parquet").field("messages").type)
    sections = {"input": {"prompt_column": None, "messages_column": "messages", "system_prompt": "S"}}
    rows_pa = decoded(tmp_path, tmp_path / "pa.parquet", **sections)
    rows_pl = decoded(tmp_path, tmp_path / "pl.parquet", **sections)
    assert [(r.request_id, r.prompt) for r in rows_pa] == [(r.request_id, r.prompt) for r in rows_pl]
    # The job's system prompt is added unless the row brings its own.
    assert rows_pa[0].prompt == [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    assert rows_pa[1].prompt == MESSAGES[1]
    pl.DataFrame({"id": ["a", "b"], "prompt": ["x", "y"]}).write_parquet(tmp_path / "text.parquet")
    rows = decoded(tmp_path, tmp_path / "text.parquet", input={"apply_chat_template": False})
    assert [(r.request_id, r.prompt) for r in rows] == [("a", "x"), ("b", "y")]


def test_invalid_utf8_null_and_empty_are_row_errors(tmp_path):
    prompts = pa.array([b"fine", b"bad \xff\xfe bytes", None, b"  "], pa.binary()).view(pa.string())
    write_parquet(tmp_path / "in.parquet", {"id": [0, 1, 2, 3], "prompt": prompts})
    rows = decoded(tmp_path, tmp_path / "in.parquet")
    assert rows[0].error is None and rows[0].prompt == [{"role": "user", "content": "fine"}]
    assert "not valid UTF-8" in rows[1].error and rows[1].request_id == "1"
    assert rows[2].error == "prompt is null"
    assert rows[3].error == "prompt is empty"


def test_read_rows_covers_exactly_the_range_across_row_groups(tmp_path):
    path = write_parquet(tmp_path / "in.parquet", {"id": list(range(50)), "prompt": [f"p{i}" for i in range(50)]},
                         row_group_size=7)
    storage = Storage(str(path))
    file = inspect_file(storage, str(path))
    batches = list(read_rows(storage, file, 5, 23, ["id"], batch_size=4))
    assert all(b.num_rows <= 4 for b in batches)
    assert [i for b in batches for i in b.column("id").to_pylist()] == list(range(5, 23))
    assert next(read_rows(storage, file, 49, 50, ["id"])).column("id").to_pylist() == [49]


def test_listing_files_folders_globs_and_memory(tmp_path):
    for name in ("b.parquet", "a.parquet", "sub/c.parquet"):
        write_parquet(tmp_path / "in" / name, {"id": [1]})
    (tmp_path / "in" / "_SUCCESS").write_text("{}")
    write_parquet(tmp_path / "in" / ".hidden.parquet", {"id": [1]})

    def names(paths: list[str]) -> list[str]:
        return [p.rsplit("/", 1)[-1] for p in paths]

    assert names(list_input_files(Storage(str(tmp_path / "in")))) == ["a.parquet", "b.parquet", "c.parquet"]
    assert names(list_input_files(Storage(str(tmp_path / "in" / "*.parquet")))) == ["a.parquet", "b.parquet"]
    fs = fsspec.filesystem("memory")
    with fs.open("/reader-test/x.parquet", "wb") as f:
        pq.write_table(pa.table({"id": [1, 2, 3]}), f)
    storage = Storage("memory://reader-test/")
    [path] = list_input_files(storage)
    assert inspect_file(storage, path).num_rows == 3
    fs.rm("/reader-test", recursive=True)


def test_units_are_deterministic_row_ranges(tmp_path):
    storage = Storage(str(tmp_path))
    files = []
    for name, n in (("a.parquet", 25), ("b.parquet", 7)):
        files.append(inspect_file(storage, str(write_parquet(tmp_path / name, {"id": list(range(n))}))))
    units = plan_units(files, rows_per_unit=10)
    assert [(u.output_name, u.file.path.rsplit("/", 1)[-1], u.start, u.stop) for u in units] == [
        ("part-00000.parquet", "a.parquet", 0, 10), ("part-00001.parquet", "a.parquet", 10, 20),
        ("part-00002.parquet", "a.parquet", 20, 25), ("part-00003.parquet", "b.parquet", 0, 7)]
    assert [(u.index, u.num_rows) for u in plan_units(files, 10, limit=12)] == [(0, 10), (1, 2)]
    runs = contiguous_runs([units[0], units[1], units[3]])  # unit 2 already done
    assert [[u.index for u in run] for run in runs] == [[0, 1], [3]]
