"""The output-folder lock on object stores: a lease object created only if absent, refreshed while the run lives.

Each store gives three primitives on one object: create-if-absent, read (bytes + a version token) and
replace-if-unchanged (compare-and-swap on that token). S3 has all three natively (PUT with If-None-Match: *
and If-Match: ETag; moto's local server honours them). memory:// lives in this process only, so a process
lock makes them atomic. Other stores get a best-effort version (create through fsspec's mode="create",
check-then-write for replace): two runs starting within the same moment may both get in there, and a
warning says so.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import threading
import time
from dataclasses import replace

from batchgen.pipeline.output.lock_holder import FolderLock, Holder, LockHeld, LockLost, iso_time
from batchgen.pipeline.storage import Storage

log = logging.getLogger("batchgen.pipeline")

LEASE_SECONDS = 60.0  # an object-store lease lives this long unless refreshed
CLOCK_SKEW_SECONDS = 10.0  # a lease is taken over only this long after it expired: hosts' clocks differ
_MEMORY_MUTEX = threading.RLock()  # replace and delete read under it too
_warned_protocols: set[str] = set()


class ConditionalStore:
    """create / read / replace / delete on one object, the last three guarded by a version token."""

    def __init__(self, fs):
        self.fs = fs

    def create(self, path: str, data: bytes) -> str | None:
        """Write `data` only if nothing is at `path`; its token, or None when something is."""
        try:
            self.fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            return None
        return _digest(data)

    def read(self, path: str) -> tuple[bytes, str] | None:
        try:
            data = self.fs.cat_file(path)
        except FileNotFoundError:
            return None
        return data, _digest(data)

    def replace(self, path: str, data: bytes, token: str) -> str | None:
        """Write `data` only if the object is still the version `token` names; the new token, or None."""
        current = self.read(path)
        if current is None or current[1] != token:
            return None
        self.fs.pipe_file(path, data)
        return _digest(data)

    def delete(self, path: str, token: str) -> None:
        current = self.read(path)
        if current is not None and current[1] == token:
            self.fs.rm_file(path)


class MemoryStore(ConditionalStore):
    """memory:// is one dict in this process: a process-wide mutex makes check-and-write atomic."""

    def create(self, path, data):
        with _MEMORY_MUTEX:
            return super().create(path, data)

    def read(self, path):
        with _MEMORY_MUTEX:
            return super().read(path)

    def replace(self, path, data, token):
        with _MEMORY_MUTEX:
            return super().replace(path, data, token)

    def delete(self, path, token):
        with _MEMORY_MUTEX:
            super().delete(path, token)


class S3Store(ConditionalStore):
    """Conditional PUTs: If-None-Match: * to create, If-Match: <ETag> to replace (the token is the ETag)."""

    def create(self, path, data):
        return self._put_if(path, data, mode="create")

    def read(self, path):
        # The ETag first, then the bytes: bytes newer than the token only make a later If-Match fail.
        self.fs.invalidate_cache(path)
        try:
            etag = self.fs.info(path)["ETag"]
            data = self.fs.cat_file(path)
        except FileNotFoundError:
            return None
        return data, etag

    def replace(self, path, data, token):
        return self._put_if(path, data, IfMatch=token)

    def _put_if(self, path, data, **condition):
        """One conditional PUT; the new ETag, or None when the condition failed (the object exists
        for a create, is gone or changed for a replace)."""
        try:
            response = self.fs.pipe_file(path, data, **condition)
        except (FileExistsError, FileNotFoundError):
            return None
        except OSError as exc:
            if _is_precondition_failure(exc):
                return None
            raise
        return response["ETag"]


def _is_precondition_failure(exc: OSError) -> bool:
    cause = getattr(exc, "__cause__", None)
    code = getattr(cause, "response", {}).get("Error", {}).get("Code") if cause is not None else None
    return code in ("PreconditionFailed", "412") or (code is None and exc.errno == errno.EINVAL)


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def conditional_store(fs) -> ConditionalStore:
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    if "memory" in protocols:
        return MemoryStore(fs)
    if "s3" in protocols or "s3a" in protocols:
        return S3Store(fs)
    if protocols[0] not in _warned_protocols:
        _warned_protocols.add(protocols[0])
        log.warning("%s:// has no conditional writes batchgen knows of: the output folder's lock is best "
                    "effort there (two runs started at the same moment may both get in)", protocols[0])
    return ConditionalStore(fs)


class LeaseLock(FolderLock):
    """A lease on an object store (see the module docstring); raises LockHeld when a live holder has it."""

    def __init__(self, storage: Storage, holder: Holder, shared: bool, name: str, lease_seconds: float):
        self.storage = storage
        self.store = conditional_store(storage.fs)
        self.lease_seconds = lease_seconds
        self.name = name
        self.is_shared = shared
        # Shared holders each own a marker beside the exclusive lock's object; an exclusive holder owns it.
        self.path = storage.join(f"{name}.shared-{holder.run_id}" if shared else name)
        self.holder = holder
        self.token: str | None = None
        self.valid_until = 0.0  # monotonic: past this, a refresh has not succeeded in time
        self.is_lost = False
        self._mutex = threading.Lock()
        self._stop = threading.Event()
        self._acquire()
        try:
            self._check_other_mode()
        except BaseException:
            self._delete()
            raise
        self._thread = start_refresher(self._refresh, refresh_interval(lease_seconds), self._stop)

    def _lease_bytes(self) -> bytes:
        self.holder = replace(self.holder, expires=time.time() + self.lease_seconds)
        return self.holder.to_json().encode()

    def _acquire(self) -> None:
        sent = time.monotonic()
        token = self.store.create(self.path, self._lease_bytes())
        if token is None:
            current = self.store.read(self.path)
            if current is None:  # released between our create and read: one more try
                sent = time.monotonic()
                token = self.store.create(self.path, self._lease_bytes())
            else:
                data, current_token = current
                previous = Holder.from_json(data)
                if previous is not None and not _is_expired(previous):
                    raise LockHeld(self._held_message([previous]))
                sent = time.monotonic()
                token = self.store.replace(self.path, self._lease_bytes(), current_token)
                if token is not None:
                    log.warning("took over the expired lease of %s on %s",
                                previous.describe() if previous else "an unreadable holder",
                                self.storage.display(self.path))
            if token is None:
                raise LockHeld(f"output.path: {self.storage.url}: another run took the lock at the same "
                               "moment; try again")
        self.token = token
        self.valid_until = sent + self.lease_seconds

    def _check_other_mode(self) -> None:
        """Exclusive vs shared: each side writes its object first, then looks for the other (both may back off)."""
        if self.is_shared:
            current = self.store.read(self.storage.join(self.name))
            holders = [Holder.from_json(current[0])] if current is not None else []
        else:
            prefix = f"{self.name}.shared-"
            holders = []
            for name in self.storage.list_names():
                if name.startswith(prefix):
                    current = self.store.read(self.storage.join(name))
                    holders.append(Holder.from_json(current[0]) if current is not None else None)
        live = [h for h in holders if h is not None and not _is_expired(h)]
        if live:
            raise LockHeld(self._held_message(live))

    def _held_message(self, holders: list[Holder]) -> str:
        who = "; ".join(h.describe() for h in holders)
        until = max(h.expires or 0.0 for h in holders)
        lock_path = self.storage.display(self.storage.join(self.name))
        return (f"output.path: {self.storage.url} is in use by another batchgen run ({who}). Wait for it to "
                f"finish; if that process is known to be gone, its lease is taken over once it has expired "
                f"(at {iso_time(until + CLOCK_SKEW_SECONDS)}), or remove {lock_path}; "
                "or choose another output.path")

    def _refresh(self) -> None:
        with self._mutex:
            if self.is_lost or self.token is None:
                return
            sent = time.monotonic()
            try:
                token = self.store.replace(self.path, self._lease_bytes(), self.token)
            except Exception as exc:  # a network blip: the next refresh may work; check() watches the clock
                log.warning("could not refresh the lease on %s: %s", self.storage.display(self.path), exc)
                return
            if token is None:
                self.is_lost = True
                log.error("lost the lease on %s: another run took it over", self.storage.display(self.path))
                return
            self.token = token
            self.valid_until = sent + self.lease_seconds

    def check(self) -> None:
        if self.is_lost:
            raise LockLost(f"this run lost its lease on {self.storage.url}: another run took it over")
        if time.monotonic() >= self.valid_until:
            raise LockLost(f"this run's lease on {self.storage.url} expired before it could be refreshed")

    def release(self) -> None:
        self._stop.set()
        with self._mutex:
            if not self.is_lost:
                self._delete()
            self.token = None

    def _delete(self) -> None:
        if self.token is None:
            return
        try:
            self.store.delete(self.path, self.token)
        except Exception as exc:  # the lease expires on its own
            log.warning("could not remove the lease %s: %s", self.storage.display(self.path), exc)


def _is_expired(holder: Holder) -> bool:
    # A lease without an expiry was not written by a lease holder: nothing protects it.
    return holder.expires is None or time.time() > holder.expires + CLOCK_SKEW_SECONDS


def refresh_interval(lease_seconds: float) -> float:
    """A lease is refreshed three times per lifetime: two refreshes may fail before it runs out."""
    return lease_seconds / 3


def start_refresher(refresh, interval: float, stop: threading.Event) -> threading.Thread:
    def loop() -> None:
        while not stop.wait(interval):
            refresh()

    thread = threading.Thread(target=loop, name="batchgen-lease", daemon=True)
    thread.start()
    return thread
