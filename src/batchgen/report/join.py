"""Rows of two runs brought together by (id, sample_index) in bounded memory.

Each run's rows (only the columns the comparison reads) are split by a hash of their id into the same
number of Arrow IPC files on local disk; rows with one key land in the same partition on both sides,
so partition p of one run joins partition p of the other alone, and memory holds one pair at a time.
The partition count comes from the runs' uncompressed sizes (the Parquet footers) and a target size.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from batchgen.report.config import ReportError

KEYS = ("id", "sample_index")
MAX_PARTITIONS = 256  # files open at once per run while it is split
_CODEC = "lz4" if pa.Codec.is_available("lz4") else None


def id_kind(t: pa.DataType) -> str:
    if pa.types.is_integer(t):
        return "integer"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "string"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t):
        return "binary"
    return str(t)


_KEY_TYPE = {"integer": pa.int64(), "string": pa.large_string(), "binary": pa.large_binary()}


def common_id_type(new: pa.DataType, old: pa.DataType, new_name: str, old_name: str) -> pa.DataType:
    """The one type both runs' ids are joined as; ReportError when they cannot name the same rows."""
    kind_new, kind_old = id_kind(new), id_kind(old)
    if kind_new != kind_old or kind_new not in _KEY_TYPE:
        raise ReportError(f"different prompt sets: the ids of {new_name} are {new} and those of {old_name} are "
                          f"{old}, so no row of one can be a row of the other")
    return _KEY_TYPE[kind_new]


def num_partitions(num_bytes: int, target_bytes: int) -> int:
    return max(1, min(MAX_PARTITIONS, math.ceil(num_bytes / target_bytes)))


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64 (wrapping arithmetic): every input bit moves every output bit."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def id_hashes(ids: pa.Array) -> np.ndarray:
    """uint64 per id, equal for equal ids of one key type (int64, large_string or large_binary); nulls hash
    to 0. Text is hashed byte by byte: each byte mixed with its position, summed over the id."""
    if pa.types.is_integer(ids.type):
        return _mix(ids.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64).view(np.uint64))
    ids = pa.concat_arrays([ids])  # offset 0: the buffers start at the first id
    offsets = np.frombuffer(ids.buffers()[1], np.int64, len(ids) + 1)
    data = ids.buffers()[2]
    raw = np.frombuffer(data, np.uint8, offsets[-1]) if data is not None else np.zeros(0, np.uint8)
    lengths = np.diff(offsets)
    pos = np.arange(raw.size, dtype=np.uint64) - np.repeat(offsets[:-1], lengths).astype(np.uint64)
    contributions = _mix((pos << np.uint64(8)) | raw.astype(np.uint64))
    sums = np.concatenate([[np.uint64(0)], np.cumsum(contributions, dtype=np.uint64)])
    hashes = _mix((sums[offsets[1:]] - sums[offsets[:-1]]) ^ lengths.astype(np.uint64))
    return np.where(ids.is_valid().to_numpy(zero_copy_only=False), hashes, np.uint64(0))


def partition_of(ids: pa.Array, count: int) -> np.ndarray:
    """Which partition each id goes to: the same for equal ids of equal type, in either run."""
    if count == 1:
        return np.zeros(len(ids), np.int64)
    return (id_hashes(ids) % np.uint64(count)).astype(np.int64)


class PartitionWriter:
    """One run's rows split into `count` IPC stream files named <prefix>-<p>.arrow under `folder`."""

    def __init__(self, folder: str, prefix: str, count: int, schema: pa.Schema, id_type: pa.DataType):
        self.paths = [os.path.join(folder, f"{prefix}-{p:03d}.arrow") for p in range(count)]
        self.schema = schema.set(schema.get_field_index("id"), pa.field("id", id_type))
        self.id_type = id_type
        options = pa.ipc.IpcWriteOptions(compression=_CODEC)
        self._writers = [pa.ipc.new_stream(path, self.schema, options=options) for path in self.paths]

    def write(self, batch: pa.RecordBatch) -> None:
        ids = pc.cast(batch.column("id"), self.id_type)
        batch = pa.RecordBatch.from_arrays([ids, *batch.columns[1:]], schema=self.schema)
        where = partition_of(ids, len(self.paths))
        order = np.argsort(where, kind="stable")
        grouped = batch.take(pa.array(order))
        bounds = np.concatenate([[0], np.cumsum(np.bincount(where, minlength=len(self.paths)))])
        for p, writer in enumerate(self._writers):
            if bounds[p + 1] > bounds[p]:
                writer.write_batch(grouped.slice(bounds[p], bounds[p + 1] - bounds[p]))

    def close(self) -> None:
        for writer in self._writers:
            writer.close()


def read_partition(path: str) -> pa.Table:
    with pa.ipc.open_stream(path) as reader:
        return reader.read_all()


def joined_pairs(new_paths: list[str], old_paths: list[str]) -> Iterator[tuple[pa.Table, pa.Table, np.ndarray,
                                                                          np.ndarray]]:
    """Per partition: (new rows, old rows, new index, old index) of the full outer join on KEYS; an index
    is -1 where that run has no row with the key."""
    for new_path, old_path in zip(new_paths, old_paths):
        new, old = read_partition(new_path), read_partition(old_path)
        if new.num_rows == 0 and old.num_rows == 0:
            continue
        left = new.select(list(KEYS)).append_column("_new", pa.array(np.arange(new.num_rows)))
        right = old.select(list(KEYS)).append_column("_old", pa.array(np.arange(old.num_rows)))
        joined = left.join(right, keys=list(KEYS), join_type="full outer")
        yield (new, old, joined.column("_new").fill_null(-1).to_numpy(),
               joined.column("_old").fill_null(-1).to_numpy())
