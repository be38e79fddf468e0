"""OpenAI Batch files as a job's input: `.jsonl` lines `{"custom_id", "method", "url", "body"}`.

A batch file is checked whole before anything runs, as OpenAI validates one on upload: a line that is
not a JSON object, has no `custom_id` (a non-empty string) or repeats one makes the job bad (JobError,
exit 2) naming every such line. What is wrong inside a line with a custom_id (method, url, body) is
that request's error row instead (batch_lines.py).

To the rest of the pipeline a batch file is an input file like a Parquet shard: rows are its
non-blank lines, in order, with two columns: `custom_id` (string: the output's id) and `line` (binary:
the line as stored, decoded and checked row by row). So units, the input fingerprint, resume and the
writer treat it as they treat Parquet.
"""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa

from batchgen.openai.batch_format import CUSTOM_ID, custom_id_of
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.input_file import BATCH_BYTES, BATCH_SIZE, InputFile
from batchgen.pipeline.storage import Storage

BATCH_FORMAT = "openai_batch"
BATCH_SUFFIX = ".jsonl"
BATCH_ID_COLUMN = CUSTOM_ID
BATCH_LINE_COLUMN = "line"
BATCH_SCHEMA = pa.schema([pa.field(BATCH_ID_COLUMN, pa.string()), pa.field(BATCH_LINE_COLUMN, pa.binary())])
# A line is one request; OpenAI caps a whole batch file at 200 MB. A longer line is refused before it
# is held in memory (its prompt would be refused by input.max_prompt_bytes anyway).
MAX_LINE_BYTES = 64 << 20
MAX_PROBLEMS_SHOWN = 10
_READ_CHUNK = 1 << 20


def is_batch_path(path: str) -> bool:
    """input.format auto: a path (file or glob) ending in .jsonl names batch files."""
    return path.lower().rstrip("/").endswith(BATCH_SUFFIX)


def iter_lines(storage: Storage, path: str) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line without its newline) for each non-blank line, read in chunks.

    Raises JobError at a line over MAX_LINE_BYTES, before holding more of it.
    """
    display = storage.display(path)
    number, held = 0, bytearray()
    with storage.fs.open(path, "rb") as f:
        while True:
            chunk = f.read(_READ_CHUNK)
            if not chunk:
                break
            start = 0
            while (end := chunk.find(b"\n", start)) >= 0:
                number += 1
                held += chunk[start:end]
                _check_length(held, display, number)
                if held.strip():
                    yield number, bytes(held)
                held.clear()
                start = end + 1
            held += chunk[start:]
            _check_length(held, display, number + 1)
    if held.strip():
        yield number + 1, bytes(held)


def _check_length(held: bytearray, display: str, number: int) -> None:
    if len(held) > MAX_LINE_BYTES:
        raise JobError(f"input file {display}: line {number} is longer than {MAX_LINE_BYTES >> 20} MiB; "
                       "a batch file's line is one request")


def inspect_batch_files(storage: Storage, paths: list[str]) -> list[InputFile]:
    """Check every line of every file (a custom_id is unique across all of them); count their rows."""
    first_seen: dict[str, tuple[str, int]] = {}  # custom_id -> (file, line) where it first appears
    return [inspect_batch_file(storage, path, first_seen) for path in paths]


def inspect_batch_file(storage: Storage, path: str,
                       first_seen: dict[str, tuple[str, int]] | None = None) -> InputFile:
    """Check every line (JobError naming each bad line and every repeated custom_id); count the rows.

    `first_seen`: custom_id -> (file, line) of the files checked before this one (updated)."""
    display = storage.display(path)
    first_seen = {} if first_seen is None else first_seen
    problems: list[str] = []
    num_problems = num_rows = 0
    try:
        for number, line in iter_lines(storage, path):
            num_rows += 1
            custom_id, problem = custom_id_of(line)
            if problem is None and custom_id in first_seen:
                where, first = first_seen[custom_id]
                problem = (f"repeats custom_id {custom_id!r} of line {first}"
                           + ("" if where == display else f" of {where}"))
            elif custom_id is not None:
                first_seen[custom_id] = (display, number)
            if problem is not None:
                num_problems += 1
                if len(problems) < MAX_PROBLEMS_SHOWN:
                    problems.append(f"line {number} {problem}")
    except JobError:
        raise
    except Exception as exc:
        raise JobError(f"input file {display} is unreadable: {exc}") from None
    if num_problems:
        more = f"\n  ... and {num_problems - len(problems)} more" if num_problems > len(problems) else ""
        raise JobError(f"input file {display} is not a valid OpenAI batch file ({num_problems} bad line(s); "
                       "each line is a JSON object with a unique, non-empty string custom_id):\n  "
                       + "\n  ".join(problems) + more)
    if not num_rows:
        raise JobError(f"input file {display} holds no requests (an empty batch file)")
    return InputFile(path, display, num_rows, BATCH_SCHEMA, format=BATCH_FORMAT)


def read_batch_rows(storage: Storage, file: InputFile, start: int, stop: int,
                    columns: list[str]) -> Iterator[pa.RecordBatch]:
    """Rows [start, stop) (non-blank lines) of a checked batch file as batches of `columns`."""
    ids: list[str] = []
    lines: list[bytes] = []
    num_bytes = 0

    def batch() -> pa.RecordBatch:
        table = {BATCH_ID_COLUMN: pa.array(ids, pa.string()), BATCH_LINE_COLUMN: pa.array(lines, pa.binary())}
        return pa.RecordBatch.from_arrays([table[c] for c in columns], names=columns)

    row = 0
    for _, line in iter_lines(storage, file.path):
        if row >= stop:
            break
        if row >= start:
            custom_id, problem = custom_id_of(line)
            if problem is not None:  # inspect_batch_file passed it: the file changed under the run
                raise RuntimeError(f"{file.display} changed during the run: row {row} {problem}")
            ids.append(custom_id)
            lines.append(line)
            num_bytes += len(line)
            if len(ids) >= BATCH_SIZE or num_bytes >= BATCH_BYTES:
                yield batch()
                ids, lines, num_bytes = [], [], 0
        row += 1
    if ids:
        yield batch()
