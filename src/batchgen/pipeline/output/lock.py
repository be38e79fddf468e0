"""One run per output folder: a lock held for the run's whole life.

Local and shared POSIX filesystems: `flock` on `_batchgen.lock` in the folder. The kernel drops it
when the process ends, kill -9 included, so it can never go stale; the file itself stays (deleting
a flock file while someone may be opening it would let two runs lock two different files).

Object stores: a lease object, `_batchgen.lock`, created only if absent (S3: a conditional PUT), naming
its holder and when it expires; a thread refreshes it while the run lives (a compare-and-swap on the
object's ETag), and another run takes it over only once it has expired. A holder that cannot refresh
(paused, partitioned) stops committing before its lease runs out: `check()` is called before every commit.

Modes: a plain run holds the folder exclusively. Static shards hold it shared (many shards at once,
no exclusive run) and lock their own shard exclusively under another name (`lock_name`).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
from dataclasses import dataclass, field

from batchgen.pipeline.errors import JobError
from batchgen.pipeline.output.lease import LEASE_SECONDS, LeaseLock
from batchgen.pipeline.output.lock_holder import FolderLock, Holder, LockHeld
from batchgen.pipeline.storage import Storage

log = logging.getLogger("batchgen.pipeline")

LOCK_NAME = "_batchgen.lock"


def lock_name(shard: str | None = None) -> str:
    """The lock object of the folder (None) or of one shard of it."""
    return LOCK_NAME if shard is None else f"_batchgen.shard-{shard}.lock"


def lock_folder(storage: Storage, holder: Holder | None = None, *, shared: bool = False,
                name: str = LOCK_NAME, lease_seconds: float = LEASE_SECONDS) -> FolderLock:
    """Take the lock `name` of the folder `storage` is rooted at, or raise LockHeld naming the holder."""
    holder = holder or Holder.this_process("shared" if shared else "exclusive")
    if storage.is_local:
        return _FlockLock(storage, holder, shared, name)
    return LeaseLock(storage, holder, shared, name, lease_seconds)


@dataclass
class _FlockLock(FolderLock):
    storage: Storage
    holder: Holder
    is_shared: bool
    name: str
    fd: int | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        os.makedirs(self.storage.root, exist_ok=True)
        path = self.storage.join(self.name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if self.is_shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise LockHeld(self._held_message(path)) from None
            raise JobError(f"output.path: cannot lock {path} ({exc}); the folder must be on a filesystem "
                           "with working flock (on NFS, mount without local_lock)") from None
        if not self.is_shared:
            os.ftruncate(fd, 0)  # an exclusive holder is alone: earlier holders' lines are history
        os.write(fd, (self.holder.to_json() + "\n").encode())  # O_APPEND: shared holders' lines never mix
        self.fd = fd

    def _held_message(self, path: str) -> str:
        return _held_message(self.storage, path)

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def _held_message(storage: Storage, path: str) -> str:
    holders = _live_holders(_read_lines(path))
    who = "; ".join(h.describe() for h in holders) or "a process that did not record itself"
    return (f"output.path: {storage.url} is in use by another batchgen run ({who}). "
            f"Wait for it to finish: its lock ({path}) is released when that process exits, even if killed; "
            "or choose another output.path")


def raise_if_locked(storage: Storage, shared: bool = False) -> None:
    """LockHeld when a run holds a local folder in a mode that excludes this one (`shared`: a static
    shard's), checked before a run spends minutes loading its engine. It creates nothing (no folder,
    no lock file) and takes the lock only for the instant of the test; open_run takes it for real.
    Object stores are not probed: their lease is taken by open_run alone."""
    if not storage.is_local:
        return
    path = storage.join(LOCK_NAME)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # no lock file yet (a new folder), or none readable: open_run decides
        return
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise LockHeld(_held_message(storage, path)) from None
    finally:
        os.close(fd)  # releases the probe's lock


def _read_lines(path: str) -> list[Holder]:
    try:
        with open(path, "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    return [h for h in (Holder.from_json(line) for line in lines) if h is not None]


def _live_holders(holders: list[Holder]) -> list[Holder]:
    """Drop lines of processes on this host that are gone (shared holders append; nobody trims)."""
    here = socket.gethostname()
    alive = []
    for h in holders:
        if h.host == here:
            try:
                os.kill(h.pid, 0)
            except ProcessLookupError:
                continue
            except PermissionError:
                pass
        alive.append(h)
    return alive
