"""The machine a bench result was measured on: CPU, threads, library versions, source commit, load.

Recorded with every result so that figures from different machines or commits are not compared
as if they were alike.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path

import torch

from batchgen.engine.runner.cpu_allocator import keep_freed_memory


def machine_fingerprint() -> dict:
    """CPU model and count, torch threads, torch/transformers/python versions, git commit, allocator."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    import transformers

    return {"cpu": cpu, "num_cpus": os.cpu_count(), "num_threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "git_commit": git_commit(),
            "glibc_malloc_tuned": keep_freed_memory()}  # both sides, see run_bench


def cpu_busy_fraction(window_s: float = 0.5) -> float | None:
    """Share of all CPUs' time spent busy over a short window while this process idles (Linux)."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
        return sum(values) - idle, sum(values)

    try:
        busy0, total0 = sample()
        time.sleep(window_s)
        busy1, total1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return (busy1 - busy0) / (total1 - total0) if total1 > total0 else None


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=Path(__file__).parent, capture_output=True, text=True,
                             timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_commit() -> str | None:
    """The source commit, with '+dirty' when tracked files differ from it (recorded results must say)."""
    commit = _git("rev-parse", "--short", "HEAD")
    if commit and _git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    return commit
