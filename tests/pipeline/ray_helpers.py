"""A local Ray cluster for a test module, and finding and killing EngineReplica processes from a test (no
dashboard or state API needed)."""

from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path


def replica_pids() -> list[int]:
    """Live processes whose title Ray set to ray::EngineReplica (its actor workers)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if cmdline.startswith(b"ray::EngineReplica") and state != "Z":
            pids.append(int(entry.name))
    return sorted(pids)


def num_committed(folder: Path) -> int:
    return len(list((folder / "_commits").glob("*.json")))


class Killer(threading.Thread):
    """SIGKILLs replica processes: once `after_commits` parts are committed, `count` of them (None: every
    replica that ever appears, until stopped)."""

    def __init__(self, folder: Path, after_commits: int = 1, count: int | None = 1):
        super().__init__(daemon=True)
        self.folder = folder
        self.after_commits = after_commits
        self.count = count
        self.killed: list[int] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            if num_committed(self.folder) >= self.after_commits:
                for pid in replica_pids():
                    if self.count is not None and len(self.killed) >= self.count:
                        return
                    try:
                        os.kill(pid, signal.SIGKILL)
                        self.killed.append(pid)
                    except ProcessLookupError:
                        pass
            time.sleep(0.02)


@contextmanager
def local_ray_cluster():
    """A 2-CPU local Ray cluster (the `ray` module while it runs), shut down after. Ray's memory monitor kills
    workers when the machine's memory is above 95%, whoever uses it: on a shared test machine that would kill
    replicas for other processes' memory, so it is off here."""
    import pytest
    import ray

    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_memory_monitor_refresh_ms", "0")
        ray.init(num_cpus=2, include_dashboard=False, address="local", _node_ip_address="127.0.0.1",
                 log_to_driver=False)
        try:
            yield ray
        finally:
            ray.shutdown()
