"""Who holds an output folder's lock, and what a held lock offers (the local flock and the object-store
lease alike): Holder, FolderLock, and the errors LockHeld and LockLost. lock.py picks the kind."""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

from batchgen.pipeline.errors import JobError


@dataclass(frozen=True)
class Holder:
    """Who holds (or wants) a lock: enough for a person to find the process."""

    run_id: str
    host: str
    pid: int
    started: float  # epoch seconds
    mode: str = "exclusive"  # exclusive | shared
    expires: float | None = None  # leases only: epoch seconds

    @staticmethod
    def this_process(mode: str = "exclusive") -> Holder:
        return Holder(uuid.uuid4().hex[:12], socket.gethostname(), os.getpid(), time.time(), mode)

    def describe(self) -> str:
        text = f"pid {self.pid} on host {self.host}, started {iso_time(self.started)}, run {self.run_id}"
        if self.mode == "shared":
            text = "shared holder " + text
        return text

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str | bytes) -> Holder | None:
        try:
            raw = json.loads(text)
            return Holder(str(raw["run_id"]), str(raw["host"]), int(raw["pid"]), float(raw["started"]),
                          str(raw.get("mode", "exclusive")), raw.get("expires"))
        except (ValueError, KeyError, TypeError):
            return None


def iso_time(epoch: float) -> str:
    """UTC, to the second: how a person compares a lease expiry with a clock."""
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class LockHeld(JobError):
    """Another run holds the output folder (exit 2: wait for it, nothing is wrong with this job)."""


class LockLost(RuntimeError):
    """This run's lease expired or was taken over: it must stop writing."""


class FolderLock:
    """A held lock. `check()` before each commit; `release()` (or leaving the `with` block) when done."""

    holder: Holder

    def check(self) -> None:
        """Raise LockLost when this run may no longer write to the folder."""

    def release(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> FolderLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
