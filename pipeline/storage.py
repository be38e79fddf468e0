"""fsspec plumbing: one place that knows local paths from object stores, and how to write atomically."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from batchgen.pipeline.errors import JobError

TEMP_PREFIX = "."  # temp files are hidden: pyarrow/polars dataset readers skip names starting with . or _
TEMP_SUFFIX = ".tmp"


class Storage:
    """A filesystem plus the root path of a job's input or output (local, memory://, s3://, gs://, ...)."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None):
        self.url = url
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        except (ImportError, ValueError) as exc:  # unknown protocol or its package missing (s3fs, gcsfs)
            raise JobError(f"cannot open {url}: {exc}") from None

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    def display(self, path: str) -> str:
        """The path as a user would type it: plain for local files, with the protocol otherwise."""
        return path if self.is_local else self.fs.unstrip_protocol(path)

    def join(self, name: str) -> str:
        return self.root.rstrip("/") + "/" + name

    def list_names(self) -> list[str]:
        """File names directly under the root (empty when the folder does not exist)."""
        try:
            entries = self.fs.ls(self.root, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in entries)

    def write_atomic(self, name: str, write: Callable[[Any], None]) -> str:
        """Write a file under the root whole or not at all; `write` gets a path (local) or a binary sink.

        Locally: a hidden temp file in the same folder, fsync, rename (atomic on POSIX). On object
        stores: the bytes are built in memory and put as one object, so a crash or an exception
        before the put leaves nothing, and the put itself is all-or-nothing.
        """
        final = self.join(name)
        if self.is_local:
            os.makedirs(self.root, exist_ok=True)
            tmp = self.join(f"{TEMP_PREFIX}{name}.{uuid.uuid4().hex[:8]}{TEMP_SUFFIX}")
            try:
                write(tmp)
                with open(tmp, "rb+") as f:
                    os.fsync(f.fileno())
                os.replace(tmp, final)
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

    def read_text(self, name: str) -> str:
        with self.fs.open(self.join(name), "rb") as f:
            return f.read().decode()

    def remove(self, name: str) -> None:
        self.fs.rm(self.join(name))

    def remove_stale_temps(self) -> None:
        """Temp files of a killed run (local only: object stores never see one)."""
        for name in self.list_names():
            if name.startswith(TEMP_PREFIX) and name.endswith(TEMP_SUFFIX):
                self.remove(name)
