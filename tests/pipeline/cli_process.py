"""`batchgen` as a subprocess, and killing one mid-job: the scaffolding of the resume tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def batchgen(*args: str) -> list[str]:
    """The command line of `batchgen ARGS` with this interpreter."""
    return [sys.executable, "-m", "batchgen.cli.main", *args]


def part_files(folder: Path) -> dict[str, int]:
    """Committed unit files (a part and its commit record, written right after it) and their mtimes."""
    return {p.name: p.stat().st_mtime_ns for p in folder.glob("part-*.parquet")
            if (folder / "_commits" / f"{p.stem}.json").exists()}


def sigkill_after_first_part(command: list[str], out: Path, timeout_s: float = 240) -> dict[str, int]:
    """Start `command`, SIGKILL it as soon as `out` holds a committed unit file; returns part_files(out)
    after the kill. Fails if the run ended (or the timeout passed) before it could be killed mid-job."""
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    while not part_files(out) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None, "the run ended before it could be killed mid-job"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return part_files(out)


def child_pids(pid: int) -> dict[int, str]:
    """{pid: command line} of the live processes whose parent is `pid` (Linux /proc)."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                children[int(stat.parent.name)] = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return children


def sigkill_worker_after_first_part(command: list[str], out: Path, stderr, timeout_s: float = 240) -> subprocess.Popen:
    """Start `command` (a run with tensor_parallel_size > 1; stderr to the open file `stderr`) and, as
    soon as `out` holds a committed unit file, SIGKILL its tensor-parallel worker process (a spawned
    child, not multiprocessing's resource tracker). Returns the still-running run; fails if it ended first."""
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)
    deadline = time.monotonic() + timeout_s
    while not part_files(out) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    workers = [pid for pid, cmd in child_pids(proc.pid).items()
               if "multiprocessing.spawn" in cmd and "resource_tracker" not in cmd]
    assert proc.poll() is None, "the run ended before its worker could be killed mid-job"
    assert len(workers) == 1, f"expected one worker process, found {child_pids(proc.pid)}"
    os.kill(workers[0], signal.SIGKILL)
    return proc
