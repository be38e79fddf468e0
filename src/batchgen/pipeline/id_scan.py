"""Repeated ids: found before any generation, by one streaming pass over the id column.

An id names a request: its output rows, its resume bookkeeping and its random draws. A job whose ids
repeat is a bad job unless `input.allow_duplicate_ids: true`; then each repeat is its own request,
keyed inside the pipeline by (id, occurrence number) and drawing its own samples, while the output's
`id` column keeps the id as given. Memory: the set of distinct ids (plus the positions of repeats).
"""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa

from batchgen.pipeline.errors import JobError
from batchgen.pipeline.output import WorkUnit, contiguous_runs
from batchgen.pipeline.reader import binary_type, read_rows
from batchgen.pipeline.storage import Storage

Position = tuple[str, int]  # (input file path, row within the file)
_KEY_SEPARATOR = "\x1f"  # ASCII unit separator: an id given in a file practically never holds it


def repeat_key(request_id: str, occurrence: int) -> str:
    """The internal request key of the occurrence-th repeat (1, 2, ...) of an id; the id itself for the first."""
    return request_id if occurrence == 0 else f"{request_id}{_KEY_SEPARATOR}{occurrence}"


def scan_ids(storage: Storage, units: list[WorkUnit], id_column: str, id_type: pa.DataType,
             allow_duplicates: bool) -> dict[Position, int]:
    """{position: occurrence number} of every repeated id (first occurrences are not listed).

    Raises JobError naming the id and both positions at the first repeat unless `allow_duplicates`.
    """
    counts: dict = {}
    repeats: dict[Position, int] = {}
    for position, value in _iter_ids(storage, units, id_column, id_type):
        if value is None:
            continue  # a null id is that row's error, not a repeat
        occurrence = counts.get(value, 0)
        counts[value] = occurrence + 1
        if occurrence:
            if not allow_duplicates:
                first = _first_position(storage, units, id_column, id_type, value)
                raise JobError(
                    f"input.id_column: id {_show(value)} appears more than once: row {first[1]} of "
                    f"{storage.display(first[0])} and row {position[1]} of {storage.display(position[0])}; "
                    "ids must be unique (set input.allow_duplicate_ids: true to run every repeat as a "
                    "request of its own)")
            repeats[position] = occurrence
    return repeats


def _iter_ids(storage: Storage, units: list[WorkUnit], id_column: str,
              id_type: pa.DataType) -> Iterator[tuple[Position, object]]:
    # Strings as bytes: invalid UTF-8 is that row's error later, not a crash here.
    target = binary_type(id_type)
    for run in contiguous_runs(units):
        file = run[0].file
        row = run[0].start
        for batch in read_rows(storage, file, run[0].start, run[-1].stop, [id_column]):
            for value in batch.column(0).cast(target).to_pylist():
                yield (file.path, row), value
                row += 1


def _first_position(storage: Storage, units: list[WorkUnit], id_column: str, id_type: pa.DataType,
                    value: object) -> Position:
    # Only when the job is refused: a second pass keeps the first pass's memory to the id set.
    return next(position for position, v in _iter_ids(storage, units, id_column, id_type) if v == value)


def _show(value: object) -> str:
    if isinstance(value, bytes):
        return repr(value.decode("utf-8", errors="backslashreplace"))
    return repr(value)
