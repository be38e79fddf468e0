"""The input's fingerprint: which files, how big, how many rows, which version of each.

Recorded in `_batchgen.json` when an output folder is started; a resume compares the input against it
before any generation, because units are "the k-th block of rows of the sorted file list": an added,
removed, grown or rewritten file would renumber or change them, losing or duplicating rows.
The version is what the store gives: the modification time locally (nanoseconds), the ETag on S3,
the generation on GCS; a store that gives none is compared by size and row count only.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from batchgen.pipeline.input_file import InputFile
from batchgen.pipeline.storage import Storage, version_tag

_TIME_KEYS = ("mtime", "LastModified", "last_modified", "updated", "created")


@dataclass(frozen=True)
class FileFingerprint:
    path: str  # as displayed (with the protocol for object stores)
    size: int
    num_rows: int
    version: str | None  # "mtime_ns:...", "ETag:...", "generation:...", or None

    @staticmethod
    def from_dict(raw: dict) -> FileFingerprint:
        return FileFingerprint(str(raw["path"]), int(raw["size"]), int(raw["num_rows"]), raw.get("version"))


def fingerprint_files(storage: Storage, files: list[InputFile]) -> list[FileFingerprint]:
    return [_fingerprint(storage, f) for f in files]


def _fingerprint(storage: Storage, file: InputFile) -> FileFingerprint:
    if storage.is_local:
        stat = os.stat(file.path)
        return FileFingerprint(file.display, stat.st_size, file.num_rows, f"mtime_ns:{stat.st_mtime_ns}")
    info = storage.fs.info(file.path)
    version = version_tag(info)
    if version is None:
        key = next((k for k in _TIME_KEYS if info.get(k) is not None), None)
        version = None if key is None else f"{key}:{info[key]}"
    return FileFingerprint(file.display, int(info.get("size") or 0), file.num_rows, version)


def to_manifest(fingerprints: list[FileFingerprint]) -> list[dict]:
    return [asdict(f) for f in fingerprints]


def describe_changes(recorded: list[FileFingerprint], current: list[FileFingerprint]) -> list[str]:
    """One line per changed file (added, removed, grown, shrunk, rewritten); empty when the input is the same."""
    before = {f.path: f for f in recorded}
    now = {f.path: f for f in current}
    changes = []
    for path, f in now.items():
        if path not in before:
            changes.append(f"{path} was added ({f.num_rows:,} rows)")
    for path, old in before.items():
        new = now.get(path)
        if new is None:
            changes.append(f"{path} was removed (it had {old.num_rows:,} rows)")
        elif new.num_rows > old.num_rows:
            changes.append(f"{path} grew from {old.num_rows:,} to {new.num_rows:,} rows")
        elif new.num_rows < old.num_rows:
            changes.append(f"{path} shrank from {old.num_rows:,} to {new.num_rows:,} rows")
        elif new.size != old.size or new.version != old.version:
            what = (f"size {old.size:,} -> {new.size:,} bytes" if new.size != old.size
                    else f"same size, {old.version} -> {new.version}")
            changes.append(f"{path} was rewritten (same {new.num_rows:,} rows; {what})")
    if not changes and [f.path for f in recorded] != [f.path for f in current]:
        changes.append("the input files are listed in another order")
    return changes
