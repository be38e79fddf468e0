"""Streaming Parquet reading through fsspec: list shards, read footers, yield row ranges batch by batch.

Never the whole dataset, nor a whole row group, in memory: a read walks the row groups that overlap its
range page by page (a buffered stream, no pre-buffering of column chunks) and yields batches whose row
count is chosen from the footer's bytes per row, so a file of huge rows reads in small batches.
Columns come back in their stored types; parquet_rows.py casts the text it decodes to binary first
(`binary_type`), so one row of invalid UTF-8 becomes that row's error instead of sinking the column.
"""

from __future__ import annotations

import glob as globlib
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.pipeline.batch_file import read_batch_rows
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.input_file import BATCH_BYTES, BATCH_SIZE, InputFile
from batchgen.pipeline.storage import Storage

READ_BUFFER_BYTES = 1 << 20  # the stream buffer for column chunks, instead of reading each one whole


def list_input_files(storage: Storage, suffix: str = ".parquet") -> list[str]:
    """The input files a file / folder / glob / URI names, sorted so unit numbering is stable.

    A folder contributes its files ending in `suffix` (.parquet, or .jsonl for batch files)."""
    fs, root = storage.fs, storage.root
    try:
        if globlib.has_magic(root):
            paths = [p for p in fs.glob(root) if fs.isfile(p) and not _is_hidden(p.rsplit("/", 1)[-1])]
        elif fs.isdir(root):
            paths = [p for p in fs.find(root) if p.endswith(suffix)
                     and not any(_is_hidden(part) for part in p[len(root):].split("/") if part)]
        elif fs.exists(root):
            paths = [root]
        else:
            raise JobError(f"input.path: {storage.url} does not exist")
    except JobError:
        raise
    except Exception as exc:  # permissions, network, bad credentials: name the path
        raise JobError(f"input.path: cannot list {storage.url}: {exc}") from None
    if not paths:
        raise JobError(f"input.path: {storage.url} holds no {suffix} files")
    return sorted(paths)


def _is_hidden(name: str) -> bool:
    # As Spark, pyarrow and polars do: _SUCCESS, _metadata, .temp files are not data.
    return name.startswith(("_", "."))


def inspect_file(storage: Storage, path: str) -> InputFile:
    """Read one file's footer (row count, schema); a truncated or non-Parquet file fails here, by name."""
    display = storage.display(path)
    try:
        with storage.fs.open(path, "rb") as f:
            meta = pq.ParquetFile(f).metadata
            schema = meta.schema.to_arrow_schema()
    except Exception as exc:
        raise JobError(f"input file {display} is unreadable or not a Parquet file: {exc}") from None
    return InputFile(path, display, meta.num_rows, schema)


def read_rows(storage: Storage, file: InputFile, start: int, stop: int, columns: list[str],
              batch_size: int | None = None) -> Iterator[pa.RecordBatch]:
    """Yield rows [start, stop) of `columns` of one file, in order, as batches of at most batch_size rows.

    batch_size None: up to BATCH_SIZE rows, fewer when the columns' rows are wide (BATCH_BYTES).
    """
    if start >= stop:
        return
    if file.format != "parquet":
        yield from read_batch_rows(storage, file, start, stop, columns)
        return
    with storage.fs.open(file.path, "rb") as f:
        pf = pq.ParquetFile(f, buffer_size=READ_BUFFER_BYTES, pre_buffer=False)
        if batch_size is None:
            batch_size = rows_per_batch(pf.metadata, columns)
        row_groups, first_row = [], None
        offset = 0
        for i in range(pf.metadata.num_row_groups):
            n = pf.metadata.row_group(i).num_rows
            if offset < stop and offset + n > start:
                row_groups.append(i)
                first_row = offset if first_row is None else first_row
            offset += n
        position = first_row or 0
        for batch in pf.iter_batches(batch_size=batch_size, row_groups=row_groups, columns=columns,
                                     use_threads=False):
            lo, hi = max(start - position, 0), min(stop - position, batch.num_rows)
            position += batch.num_rows
            if hi > lo:
                yield batch.slice(lo, hi - lo)
            if position >= stop:
                break


def rows_per_batch(meta: pq.FileMetaData, columns: list[str]) -> int:
    """BATCH_SIZE rows, or fewer so that a batch of `columns` decodes to about BATCH_BYTES."""
    if meta.num_rows == 0:
        return BATCH_SIZE
    wanted = set(columns)
    num_bytes = 0
    for i in range(meta.num_row_groups):
        group = meta.row_group(i)
        for j in range(group.num_columns):
            column = group.column(j)
            if column.path_in_schema.split(".", 1)[0] in wanted:
                num_bytes += column.total_uncompressed_size
    bytes_per_row = max(1, num_bytes // meta.num_rows)
    return max(1, min(BATCH_SIZE, BATCH_BYTES // bytes_per_row))


def binary_type(t: pa.DataType) -> pa.DataType:
    """The same type with every string inside it made binary (string->binary is a zero-copy cast)."""
    if pa.types.is_string(t):
        return pa.binary()
    if pa.types.is_large_string(t):
        return pa.large_binary()
    if pa.types.is_string_view(t):
        return pa.binary_view()
    if pa.types.is_list(t):
        return pa.list_(pa.field(t.value_field.name, binary_type(t.value_type)))
    if pa.types.is_large_list(t):
        return pa.large_list(pa.field(t.value_field.name, binary_type(t.value_type)))
    if pa.types.is_struct(t):
        return pa.struct([pa.field(f.name, binary_type(f.type), f.nullable) for f in t])
    return t
