"""Checkpoints: finished rows made durable as they finish, so a crash loses at most `output.checkpoint_seconds`.

A unit's part is written whole when its last row finishes. The ordering window mixes the rows of many
units, so with a large window every unit finishes near the window's end: without checkpoints a kill -9
would lose every row the window had finished, however small the units. So every `checkpoint_seconds`
(at the first engine step or finished row after that much time) the writer puts the rows that finished
since its last checkpoint, of every unit still open, into one Parquet file
`_checkpoints/<run id>-<writer>-<seq>.parquet`, written whole or not at all like a part (a temp file and a
rename locally, one object put on object stores). A row there holds its generated columns and its
input position (`_input_file`, `_input_row`: the file as the commit records name it, the row within
that file), not its unit, so checkpoints stay valid when the units are cut differently (a larger
`--limit`).

Trials that grow: `--limit` is not part of the config hash, so a run over more rows (a larger `--limit`,
or none) resumes a smaller one. Its last unit was cut short by the limit; that part covers the first
rows of a unit the larger run plans whole. The larger run (under the folder's lock, before any row is
generated) turns such a part into a checkpoint file, `_checkpoints/grown-part-NNNNN.parquet`, and
removes the part and its record: its rows are then reused like any checkpointed rows, and the unit's
whole part replaces them.

A rerun reads every checkpoint, takes the rows of its pending units from them instead of generating
them again, and writes each unit's part as before (input order, one part per unit, the same commit
record): the final layout never holds a checkpoint. A checkpoint file is deleted once every row it
holds is in a committed part; the run that writes `_SUCCESS` removes the folder. Rows already in a part
(a unit committed before the checkpoint came) are not checkpointed. Outputs are deterministic per
(seed, id, sample), so a reused row is the row the rerun would have generated.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.pipeline.output.units import WorkUnit
from batchgen.pipeline.storage import Storage, is_temp_name

log = logging.getLogger("batchgen.pipeline")

CHECKPOINTS_DIR = "_checkpoints"
FILE_COLUMN = "_input_file"
ROW_COLUMN = "_input_row"
CONFIG_KEY = b"batchgen.config_hash"

Position = tuple[str, int]  # (input file as displayed, row within it)


@dataclass
class RestoredRows:
    """What earlier runs' checkpoints hold for this run's pending units."""

    rows: dict[Position, list[dict]] = field(default_factory=dict)  # a request's output rows (sample order)
    files: dict[str, set[Position]] = field(default_factory=dict)  # checkpoint file -> the positions it holds

    @property
    def num_output_rows(self) -> int:
        return sum(len(rows) for rows in self.rows.values())


def _wanted(units: list[WorkUnit]) -> dict[str, list[tuple[int, int]]]:
    ranges: dict[str, list[tuple[int, int]]] = {}
    for unit in units:
        ranges.setdefault(unit.file.display, []).append((unit.start, unit.stop))
    return ranges


def _is_wanted(ranges: dict[str, list[tuple[int, int]]], file: str, row: int) -> bool:
    return any(start <= row < stop for start, stop in ranges.get(file, ()))


def load_checkpoints(storage: Storage, units: list[WorkUnit], config_hash: str) -> RestoredRows:
    """The checkpointed rows of `units` (the units this run is about to generate). A checkpoint of another
    config, or one that cannot be read, is skipped with a warning: its rows are generated again."""
    restored = RestoredRows()
    ranges = _wanted(units)
    for name in storage.list_names(CHECKPOINTS_DIR):
        if not name.endswith(".parquet") or is_temp_name(name):
            continue
        path = f"{CHECKPOINTS_DIR}/{name}"
        try:
            with storage.fs.open(storage.join(path), "rb") as f:
                table = pq.read_table(f)
        except Exception as exc:  # noqa: BLE001 - a checkpoint is only saved work: without it, rows run again
            log.warning("checkpoint %s is unreadable (%s): its rows are generated again", path, exc)
            continue
        if (table.schema.metadata or {}).get(CONFIG_KEY, b"").decode() != config_hash:
            log.warning("checkpoint %s is of another job config: its rows are generated again", path)
            continue
        held: set[Position] = set()
        columns = [c for c in table.column_names if c not in (FILE_COLUMN, ROW_COLUMN)]
        files, positions = table.column(FILE_COLUMN).to_pylist(), table.column(ROW_COLUMN).to_pylist()
        values = table.select(columns).to_pylist()
        for file, row, value in zip(files, positions, values):
            position = (file, row)
            held.add(position)
            if not _is_wanted(ranges, file, row):
                continue
            request = restored.rows.setdefault(position, [])
            if len(request) and request[-1]["sample_index"] >= value["sample_index"]:
                continue  # the same request in two checkpoints (cannot happen; keep the first)
            request.append(value)
        restored.files[name] = held
    return restored


class CheckpointWriter:
    """Buffers each finished request's rows and puts them in a checkpoint file every `seconds`.

    `schema`: the generated columns of a part (what a row dict holds), without id, kept and metric columns."""

    def __init__(self, storage: Storage, schema: pa.Schema, config_hash: str, run_id: str, seconds: float,
                 may_write: Callable[[], None] = lambda: None, restored: RestoredRows | None = None):
        self.schema = pa.schema([*schema, pa.field(FILE_COLUMN, pa.string()), pa.field(ROW_COLUMN, pa.int64())],
                                metadata={CONFIG_KEY: config_hash.encode()})
        self.storage = storage
        # The run id, and this writer's own tag: Ray replicas of one run checkpoint side by side.
        self.prefix = f"{run_id[:12]}-{uuid.uuid4().hex[:8]}"
        self.seconds = seconds
        self.may_write = may_write  # raises when the run lost its output folder (its lock)
        self.buffer: dict[Position, list[dict]] = {}
        self.buffer_units: dict[Position, int] = {}  # position -> unit index, to drop a committed unit's rows
        self.last_write = time.monotonic()
        self.num_files = 0
        # checkpoint file -> positions not yet in a committed part (old runs' files included)
        self.open_files: dict[str, set[Position]] = dict(restored.files) if restored else {}
        self.num_rows_written = 0

    def add(self, unit: WorkUnit, offset: int, rows: list[dict]) -> None:
        position = (unit.file.display, unit.start + offset)
        self.buffer[position] = rows
        self.buffer_units[position] = unit.index

    def maybe_write(self) -> None:
        if self.buffer and time.monotonic() - self.last_write >= self.seconds:
            self.write()

    def write(self) -> None:
        """Put every buffered row in one checkpoint file (whole or not at all)."""
        if not self.buffer:
            return
        self.may_write()
        started = time.monotonic()  # the interval runs from write to write start, however long a put takes
        positions = list(self.buffer)
        rows = [(position, row) for position in positions for row in self.buffer[position]]
        arrays = [pa.array([row[f.name] for _, row in rows], f.type) for f in self.schema
                  if f.name not in (FILE_COLUMN, ROW_COLUMN)]
        arrays += [pa.array([p[0] for p, _ in rows], pa.string()), pa.array([p[1] for p, _ in rows], pa.int64())]
        table = pa.Table.from_arrays(arrays, schema=self.schema)
        name = f"{self.prefix}-{self.num_files:06d}.parquet"
        self.storage.write_atomic(f"{CHECKPOINTS_DIR}/{name}", lambda target: pq.write_table(table, target))
        self.num_files += 1
        self.num_rows_written += table.num_rows
        self.open_files[name] = set(positions)
        self.buffer.clear()
        self.buffer_units.clear()
        self.last_write = started

    def on_committed(self, unit: WorkUnit) -> None:
        """The unit's part is committed: its buffered rows need no checkpoint, and a checkpoint file whose
        every row is now in a committed part is deleted."""
        for position in [p for p, index in self.buffer_units.items() if index == unit.index]:
            del self.buffer[position], self.buffer_units[position]
        for name in list(self.open_files):
            held = self.open_files[name]
            held.difference_update({p for p in held if p[0] == unit.file.display and unit.start <= p[1] < unit.stop})
            if not held:
                del self.open_files[name]
                path = f"{CHECKPOINTS_DIR}/{name}"
                if self.storage.fs.exists(self.storage.join(path)):
                    self.storage.remove(path)


GROWN_PREFIX = "grown-"


def requests_of_part(sample_index: list[int]) -> list[int]:
    """The request (0, 1, ...) of each row of a part, in row order: a request's rows come sorted by
    sample_index from 0 (one row per request for scoring, n for generation, a batch line's own n)."""
    request, requests = -1, []
    for index in sample_index:
        if index == 0:
            request += 1
        requests.append(max(request, 0))
    return requests


def part_to_checkpoint(storage: Storage, part: str, file: str, start: int, stop: int, config_hash: str) -> bool:
    """Rewrite a committed part of input rows [start, stop) of `file` as a checkpoint file (every column
    of the part, and each row's input position); False, writing nothing, when its rows cannot be mapped to
    input rows one request each (then the unit is simply generated again)."""
    with storage.fs.open(storage.join(part), "rb") as f:
        table = pq.read_table(f)
    if "sample_index" not in table.column_names:
        return False
    requests = requests_of_part(table.column("sample_index").to_pylist())
    if (requests[-1] + 1 if requests else 0) != stop - start:  # e.g. repeated ids of a reward job
        return False
    table = table.replace_schema_metadata({CONFIG_KEY: config_hash.encode()})
    table = table.append_column(FILE_COLUMN, pa.array([file] * table.num_rows, pa.string()))
    table = table.append_column(ROW_COLUMN, pa.array([start + r for r in requests], pa.int64()))
    name = f"{CHECKPOINTS_DIR}/{GROWN_PREFIX}{part}"
    storage.write_atomic(name, lambda target: pq.write_table(table, target))
    return True


def remove_checkpoints(storage: Storage) -> None:
    """The checkpoint folder, once every unit is committed (before `_SUCCESS`) or when a folder is cleared."""
    storage.remove_tree(CHECKPOINTS_DIR)
