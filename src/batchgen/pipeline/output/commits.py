"""Commit records: a part counts as done only when its record says what it holds and the part agrees.

`_commits/part-NNNNN.json` is written (atomically) right after its part: the unit's input range, the
part's row count, a checksum of its ids in order, its size and sha256 (and the store's ETag/generation
where there is one). A resume trusts a part only when the record exists, is this unit's, and the part's
size, content (ETag, or sha256 read back) and footer row count agree with it; otherwise the unit is
run again. A crash between a part and its record costs that unit, never a row.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.pipeline.output.units import WorkUnit
from batchgen.pipeline.storage import PartFile, Storage, version_tag

COMMITS_DIR = "_commits"


def record_name(part_name: str) -> str:
    return f"{COMMITS_DIR}/{part_name.removesuffix('.parquet')}.json"


@dataclass(frozen=True)
class CommitRecord:
    part: str
    unit: int
    input_file: str  # as displayed
    start: int
    stop: int
    num_rows: int  # output rows (input rows x n)
    id_checksum: str
    size: int
    sha256: str
    etag: str | None
    config_hash: str
    run_id: str

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1) + "\n"

    @staticmethod
    def from_json(text: str) -> CommitRecord:
        return CommitRecord(**json.loads(text))

    def matches(self, unit: WorkUnit, config_hash: str) -> bool:
        return (self.part, self.unit, self.input_file, self.start, self.stop, self.config_hash) == (
            unit.output_name, unit.index, unit.file.display, unit.start, unit.stop, config_hash)


class IdChecksum:
    """sha256 over a part's id column in row order (length-prefixed, so no two id lists collide)."""

    def __init__(self):
        self.digest = hashlib.sha256()

    def update(self, ids: pa.Array | pa.ChunkedArray) -> None:
        for value in ids.to_pylist():
            if value is None:
                self.digest.update(b"\xff\xff\xff\xff")
                continue
            blob = value if isinstance(value, bytes) else str(value).encode()
            self.digest.update(len(blob).to_bytes(4, "little") + blob)

    def hexdigest(self) -> str:
        return self.digest.hexdigest()


@dataclass(frozen=True)
class CommitContext:
    """What each part's commit record names, and the check that this run may still write (its lock)."""

    config_hash: str
    run_id: str
    may_commit: Callable[[], None] = lambda: None  # raises when the run lost its output folder

    def commit_unit(self, storage: Storage, file: PartFile, unit: WorkUnit, num_rows: int,
                    id_checksum: str) -> None:
        """Make a closed part file visible under its name, then write its record: from here the unit is done.
        The lock is checked first, so a run that lost its folder never commits."""
        self.may_commit()
        written = file.commit()
        write_record(storage, CommitRecord(
            part=unit.output_name, unit=unit.index, input_file=unit.file.display, start=unit.start,
            stop=unit.stop, num_rows=num_rows, id_checksum=id_checksum, size=written.size,
            sha256=written.sha256, etag=written.etag, config_hash=self.config_hash, run_id=self.run_id))


def write_record(storage: Storage, record: CommitRecord) -> None:
    storage.write_text_atomic(record_name(record.part), record.to_json())


def read_records(storage: Storage) -> dict[str, CommitRecord | str]:
    """{part name: its record, or why the record cannot be read}."""
    records: dict[str, CommitRecord | str] = {}
    for name in storage.list_names(COMMITS_DIR):
        if not name.endswith(".json") or name.startswith("."):
            continue
        part = name.removesuffix(".json") + ".parquet"
        try:
            records[part] = CommitRecord.from_json(storage.read_text(f"{COMMITS_DIR}/{name}"))
        except (OSError, ValueError, TypeError) as exc:
            records[part] = f"its commit record is unreadable ({exc})"
    return records


def verify_part(storage: Storage, unit: WorkUnit, entry: dict, record: CommitRecord | str | None,
                config_hash: str) -> str | None:
    """None when the part may be trusted; otherwise why not (the unit is then run again)."""
    if record is None:
        return "no commit record"
    if isinstance(record, str):
        return record
    if not record.matches(unit, config_hash):
        return "its commit record is for another unit or job"
    size = int(entry.get("size") or 0)
    if size != record.size:
        return f"size {size:,} bytes, its commit record says {record.size:,}"
    stored_version = version_tag(entry)
    if record.etag is not None and stored_version is not None:
        if stored_version != record.etag:
            return "rewritten since it was committed (its ETag/generation changed)"
    elif storage.sha256(unit.output_name) != record.sha256:
        return "its content differs from its commit record (sha256)"
    try:
        with storage.fs.open(storage.join(unit.output_name), "rb") as f:
            num_rows = pq.ParquetFile(f).metadata.num_rows
    except Exception as exc:
        return f"its footer is unreadable ({exc})"
    if num_rows != record.num_rows:
        return f"its footer says {num_rows:,} rows, its commit record {record.num_rows:,}"
    return None
