"""fsspec plumbing: one place that knows local paths from object stores, and how to write atomically."""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from batchgen.pipeline.errors import JobError

TEMP_PREFIX = "."  # temp files are hidden: pyarrow/polars dataset readers skip names starting with . or _
TEMP_SUFFIX = ".tmp"
# .NAME.<8 hex: the writing Storage's tag>.tmp: whose temp file it is can be told from its name
_TEMP_RE = re.compile(r"\..+\.([0-9a-f]{8})\.tmp")
_HASH_CHUNK = 1 << 20


@dataclass(frozen=True)
class WrittenFile:
    """What a committed file is: its size, sha256 and, where the store has one, its ETag/generation."""

    path: str
    size: int
    sha256: str
    etag: str | None = None


def is_temp_name(name: str) -> bool:
    return _TEMP_RE.fullmatch(name) is not None


class Storage:
    """A filesystem plus the root path of a job's input or output (local, memory://, s3://, gs://, ...)."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None):
        self.url = url
        self.tag = uuid.uuid4().hex[:8]  # names this Storage's temp files, so it removes only its own
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        except (ImportError, ValueError) as exc:  # unknown protocol or its package missing (s3fs, gcsfs)
            raise JobError(f"cannot open {url}: {exc}") from None

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    @property
    def protocol(self) -> str:
        return self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]

    def display(self, path: str) -> str:
        """The path as a user would type it: plain for local files, with the protocol otherwise."""
        return path if self.is_local else self.fs.unstrip_protocol(path)

    def join(self, name: str) -> str:
        return self.root.rstrip("/") + "/" + name

    def list_names(self, sub: str = "") -> list[str]:
        """File names directly under the root, or under root/sub (empty when the folder does not exist)."""
        return sorted(self.list_entries(sub))

    def list_entries(self, sub: str = "") -> dict[str, dict]:
        """{name: fsspec info (size, ETag, ...)} directly under the root or root/sub; one listing call."""
        folder = self.join(sub) if sub else self.root
        try:
            entries = self.fs.ls(folder, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return {}
        return {e["name"].rstrip("/").rsplit("/", 1)[-1]: e for e in entries}

    def temp_name(self, name: str) -> str:
        folder, _, base = name.rpartition("/")
        return (folder + "/" if folder else "") + f"{TEMP_PREFIX}{base}.{self.tag}{TEMP_SUFFIX}"

    def write_atomic(self, name: str, write: Callable[[Any], None]) -> str:
        """Write a file under the root whole or not at all; `write` gets a path (local) or a binary sink.

        Locally: a hidden temp file in the same folder, fsync, rename (atomic on POSIX). On object
        stores: the bytes are built in memory and put as one object, so a crash or an exception
        before the put leaves nothing, and the put itself is all-or-nothing.
        """
        final = self.join(name)
        if self.is_local:
            os.makedirs(os.path.dirname(final), exist_ok=True)
            tmp = self.join(self.temp_name(name))
            try:
                write(tmp)
                _fsync_replace(tmp, final)
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)
            return final
        import pyarrow as pa

        sink = pa.BufferOutputStream()
        write(sink)
        self.fs.pipe_file(final, sink.getvalue().to_pybytes())
        return final

    def write_text_atomic(self, name: str, text: str) -> str:
        def write(target: Any) -> None:
            if isinstance(target, str):
                with open(target, "w") as f:
                    f.write(text)
            else:
                target.write(text.encode())

        return self.write_atomic(name, write)

    def open_part(self, name: str) -> PartFile:
        """A local file to stream `name` into; `commit()` makes it appear whole, `abort()` leaves nothing."""
        return PartFile(self, name)

    def read_text(self, name: str) -> str:
        with self.fs.open(self.join(name), "rb") as f:
            return f.read().decode()

    def sha256(self, name: str) -> str:
        with self.fs.open(self.join(name), "rb") as f:
            return _sha256_of(f)

    def remove(self, name: str) -> None:
        self.fs.rm(self.join(name))

    def remove_tree(self, sub: str) -> None:
        if self.fs.exists(self.join(sub)):
            self.fs.rm(self.join(sub), recursive=True)

    def remove_leftover_temps(self, subs: tuple[str, ...] = ("",)) -> list[str]:
        """Temp files of runs that are gone. Only the folder's exclusive lock holder may call this:
        every run that writes here holds the lock, so no temp file it finds can belong to a live run."""
        removed = []
        for sub in subs:
            for name in self.list_names(sub):
                if is_temp_name(name):
                    path = f"{sub}/{name}" if sub else name
                    self.remove(path)
                    removed.append(path)
        return removed


class PartFile:
    """A file streamed to local disk, then committed whole: renamed in place, or put as one object.

    Locally the temp file sits in the output folder (hidden, named with the Storage's tag) and a rename
    commits it. For object stores it sits in the local temp folder and one upload commits it: the
    object appears whole or not at all, and memory holds no more than the writer's buffers.
    """

    def __init__(self, storage: Storage, name: str):
        self.storage = storage
        self.name = name
        self.final = storage.join(name)
        if storage.is_local:
            os.makedirs(os.path.dirname(self.final), exist_ok=True)
            self.path = storage.join(storage.temp_name(name))
        else:
            fd, self.path = tempfile.mkstemp(prefix="batchgen-", suffix=f"-{name.replace('/', '_')}")
            os.close(fd)

    def commit(self) -> WrittenFile:
        with open(self.path, "rb") as f:
            digest = _sha256_of(f)  # just written: read back from the page cache
        size = os.path.getsize(self.path)
        try:
            if self.storage.is_local:
                _fsync_replace(self.path, self.final)
                return WrittenFile(self.final, size, digest)
            self.storage.fs.put_file(self.path, self.final)
            self.storage.fs.invalidate_cache(self.final)
            return WrittenFile(self.final, size, digest, version_tag(self.storage.fs.info(self.final)))
        finally:
            self.abort()

    def abort(self) -> None:
        if os.path.exists(self.path):
            os.remove(self.path)


def version_tag(info: dict) -> str | None:
    """The store's own version of an object, where it has one (S3 ETag, GCS generation)."""
    for key in ("generation", "ETag", "etag"):
        if info.get(key):
            return f"{key}:{str(info[key]).strip(chr(34))}"
    return None


def _fsync_replace(tmp: str, final: str) -> None:
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)


def _sha256_of(f) -> str:
    digest = hashlib.sha256()
    while chunk := f.read(_HASH_CHUNK):
        digest.update(chunk)
    return digest.hexdigest()
