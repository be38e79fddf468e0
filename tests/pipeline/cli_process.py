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
    return [sys.executable, "-m", "batchgen.pipeline.cli", *args]


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
