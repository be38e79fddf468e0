"""A run's output folder as the report reads it: `_SUCCESS`, `_batchgen.json`, the parts, the batch files.

The one module of the report that knows the pipeline's folder layout and storage (a move of either
touches only the imports below). Local, sharded, Ray and OpenAI batch outputs share one layout:
`part-NNNNN.parquet` files (all rows), `_SUCCESS` written last, `_workers/` for the placements that
have several workers, and for `output.format: openai_batch` `output.jsonl` / `errors.jsonl` assembled
from the parts. Parts are read batch by batch, never whole.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.pipeline.errors import JobError
from batchgen.pipeline.output import ERRORS_JSONL, MANIFEST_NAME, OUTPUT_JSONL, SUCCESS_NAME
from batchgen.pipeline.run_record import RecordError, RunRecord
from batchgen.pipeline.storage import Storage
from batchgen.report.config import ReportError

PART_RE = re.compile(r"part-\d{5,}\.parquet")
OPENAI_LINE_COLUMN = "openai_line"
_TIME_KEYS = ("mtime", "LastModified", "last_modified", "updated", "created")
_COUNT_CHUNK = 1 << 20


@dataclass(frozen=True)
class Part:
    """One part file: its name, row count (from the footer) and when the store last wrote it."""

    name: str
    num_rows: int
    committed_at: float | None  # seconds since the epoch; None where the store gives no time


class RunFolder:
    """An output folder opened for reading. Raises ReportError when it is not one."""

    def __init__(self, url: str, storage_options: dict | None = None):
        try:
            self.storage = Storage(url, storage_options)
        except JobError as exc:
            raise ReportError(str(exc)) from None
        self.url = url
        entries = self.storage.list_entries()
        if not entries:
            raise ReportError(f"{url}: no such folder, or it is empty")
        success = self._read_json(SUCCESS_NAME) if SUCCESS_NAME in entries else None
        self.success = self._record(success) if success is not None else None
        self.success_metrics = _metric_entries(success.get("metrics")) if success is not None else {}
        self.success_at = _modified_at(entries[SUCCESS_NAME]) if SUCCESS_NAME in entries else None
        self.manifest = self._read_json(MANIFEST_NAME) if MANIFEST_NAME in entries else None
        names = sorted(n for n in entries if PART_RE.fullmatch(n))
        if not names and self.success is None:
            self._refuse_a_staged_jobs_folder(entries)
            raise ReportError(f"{url} holds no part-*.parquet files and no {SUCCESS_NAME}: "
                              "not a batchgen output folder")
        self.schema: pa.Schema | None = None
        self.parts = [self._read_footer(name, entries[name]) for name in names]
        self.batch_files = {name: entries[name] for name in (OUTPUT_JSONL, ERRORS_JSONL) if name in entries}

    @property
    def num_rows(self) -> int:
        return sum(p.num_rows for p in self.parts)

    @property
    def is_openai_batch(self) -> bool:
        return self.schema is not None and OPENAI_LINE_COLUMN in self.schema.names

    @property
    def column_names(self) -> list[str]:
        return self.schema.names if self.schema is not None else []

    def arrow_bytes(self, columns: list[str], sample_rows: int = 4096) -> int:
        """The in-memory (Arrow) size of these columns over every row, estimated from the first part's
        first rows: the footers' sizes are of encoded data (dictionaries, runs), often far smaller."""
        if not self.parts:
            return 0
        with self.storage.fs.open(self.storage.join(self.parts[0].name), "rb") as f:
            batch = next(pq.ParquetFile(f).iter_batches(batch_size=sample_rows, columns=columns), None)
        if batch is None or batch.num_rows == 0:
            return 0
        return int(batch.nbytes / batch.num_rows * self.num_rows)

    def check_column(self, name: str, flag: str) -> None:
        if self.schema is not None and name not in self.schema.names:
            raise ReportError(f"{flag} {name}: {self.url} has no column {name!r}; its columns are: "
                              f"{', '.join(self.schema.names)}")

    def iter_batches(self, columns: list[str], batch_rows: int) -> Iterator[tuple[int, pa.RecordBatch]]:
        """(part index, batch) over every part in order, `batch_rows` rows at a time."""
        for index, part in enumerate(self.parts):
            with self.storage.fs.open(self.storage.join(part.name), "rb") as f:
                for batch in pq.ParquetFile(f).iter_batches(batch_size=batch_rows, columns=columns):
                    yield index, batch

    def count_lines(self, name: str) -> int:
        """Lines of output.jsonl or errors.jsonl, counted in chunks."""
        count = 0
        with self.storage.fs.open(self.storage.join(name), "rb") as f:
            while chunk := f.read(_COUNT_CHUNK):
                count += chunk.count(b"\n")
        return count

    def _refuse_a_staged_jobs_folder(self, entries: dict) -> None:
        """A multi-stage job's output.path holds one folder per stage (and `_stages.json`), not rows (its
        own page is stages_page.py's; --against reaches here): say which folders can be compared."""
        from batchgen.pipeline.stages.run import STAGES_NAME

        if STAGES_NAME not in entries:
            return
        stages = self._read_json(STAGES_NAME).get("stages")
        folders = [str(s.get("folder")) for s in stages if isinstance(s, dict)] if isinstance(stages, list) else []
        raise ReportError(f"{self.url} is a multi-stage job's folder: its page (batchgen report {self.url}) "
                          "lists its stages; --against compares one stage's output folder with another's: "
                          f"{' or '.join(self.storage.join(f) for f in folders) or 'one of its sub-folders'}")

    def _record(self, success: dict) -> RunRecord:
        """`_SUCCESS` as the run record (ReportError naming the file when it is not one)."""
        try:
            return RunRecord.from_dict(success)
        except RecordError as exc:
            raise ReportError(f"{self.storage.join(SUCCESS_NAME)}: {exc}") from None

    def _read_json(self, name: str) -> dict:
        try:
            value = json.loads(self.storage.read_text(name))
        except (OSError, ValueError) as exc:
            raise ReportError(f"{self.storage.join(name)} is unreadable ({exc})") from None
        if not isinstance(value, dict):
            raise ReportError(f"{self.storage.join(name)} is not a JSON object")
        return value

    def _read_footer(self, name: str, info: dict) -> Part:
        path = self.storage.join(name)
        try:
            with self.storage.fs.open(path, "rb") as f:
                meta = pq.read_metadata(f)
        except (OSError, pa.ArrowException) as exc:
            raise ReportError(f"{path} is not a readable Parquet file ({exc})") from None
        schema = meta.schema.to_arrow_schema()
        if self.schema is None:
            self.schema = schema
        elif schema.names != self.schema.names:
            raise ReportError(f"{path} has the columns {', '.join(schema.names)}; the folder's first part has "
                              f"{', '.join(self.schema.names)}: not the parts of one job")
        return Part(name, meta.num_rows, _modified_at(info))


def _metric_entries(metrics: object) -> dict[str, dict]:
    """`_SUCCESS`'s `metrics` ({name: {value, stderr, n}}) as far as it holds numbers; {} when absent. Read
    from the JSON itself: the report reads folders of any batchgen that wrote the key."""
    if not isinstance(metrics, dict):
        return {}
    entries = {}
    for name, entry in metrics.items():
        if isinstance(entry, dict) and all(isinstance(entry.get(k), (int, float)) and not isinstance(entry.get(k), bool)
                                           for k in ("value", "stderr", "n")):
            entries[str(name)] = entry
    return entries


def _modified_at(info: dict) -> float | None:
    """The store's modification time of a listed file: local mtime, S3 LastModified, GCS updated, ..."""
    for key in _TIME_KEYS:
        value = info.get(key)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return None
