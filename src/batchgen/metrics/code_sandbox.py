"""The child side of code execution: run as a script (`python -I -B code_sandbox.py SETTINGS PROGRAM`),
it limits itself, isolates itself where the kernel lets it, and then runs one untrusted program.

Started by code_exec.run_program, never imported by batchgen's own code but for its constants; under
`-I` it imports the standard library only. What it does, in order, and where each layer holds:

1. Resource limits (setrlimit, every Unix): RLIMIT_AS (memory; Python raises MemoryError; a thread's
   stack counts too, 8 MiB each), RLIMIT_CPU a little above the wall-clock timeout (SIGXCPU, then
   SIGKILL: a backstop for the parent's clock), RLIMIT_FSIZE (files it writes), RLIMIT_CORE 0 (no core
   dumps). PR_SET_PDEATHSIG (Linux): it dies with the thread that started it, so a killed batchgen
   leaves no program behind.
2. Kernel isolation (Linux), tried in this order:
   - unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID): works for root and, where unprivileged user
     namespaces are enabled (the default on most distributions), for any user. The program then runs
     as an unmapped user (uid 65534 inside) with no capability over the host (root loses its override
     of the permissions of files it does not own), and RLIMIT_NPROC counts the tasks of this namespace
     alone (kernel 5.14+), capped at MAX_TASKS (root is exempt from RLIMIT_NPROC in any case).
   - unshare(CLONE_NEWNET | CLONE_NEWPID): root where user namespaces are refused.
   - neither (a container without CAP_SYS_ADMIN, a user where user namespaces are off, macOS): only the
     Python guards of step 3 hold, and a process that goes around them and leaves the session (setsid)
     can outlive the run.
   A new network namespace has no interface but a loopback that is down: nothing, not even 127.0.0.1
   on the host, can be reached. In a new PID namespace, when the program ends or is killed, the kernel
   kills every process left in it, even one that left the session and so escaped the parent's
   process-group kill. The program runs there as PID 2 under a small init (PID 1) of this script, so
   that signals act on it as usual.
3. Python guards (everywhere): socket creation (socket.socket, _socket.socket, create_connection,
   create_server, socketpair, fromfd) and process creation (os.fork/forkpty, os.system/popen, os.exec*,
   os.spawn*, os.posix_spawn*, subprocess.Popen, and _posixsubprocess.fork_exec, which multiprocessing
   uses) raise SandboxViolation (a PermissionError): a clear "forbidden" verdict. A determined program
   can go around them (ctypes, the classes they wrap); the kernel layers are what holds then. Asyncio's
   event loop opens a socketpair, so it does not run here.

NOT guarded: reading any file the user may read, and writing outside the scratch folder where the
user may (no mount namespace or chroot); CPU and memory of the host as a whole (limits are per
process); without a PID namespace, signals to other processes of the same user (root's, for root).
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import runpy
import signal
import sys
import traceback

# Exit statuses this script gives a program that died of MemoryError or of a guard (SandboxViolation);
# code_exec maps them to the verdicts "memory" and "forbidden". A program calling sys.exit with one of
# them only changes the reason of its own failure.
EXIT_MEMORY = 86
EXIT_FORBIDDEN = 87
# RLIMIT_NPROC inside a new user namespace, where it counts only the namespace's own tasks: the
# program's threads (process creation is refused by the guards before the kernel sees it).
MAX_TASKS = 16

_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_CLONE_NEWPID = 0x20000000
_PR_SET_PDEATHSIG = 1


class SandboxViolation(PermissionError):
    """A program tried to open a socket or start a process."""


def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _set_limits(settings: dict) -> None:
    for limit, value in (
        (resource.RLIMIT_AS, settings["memory_bytes"]),
        (resource.RLIMIT_FSIZE, settings["file_size_bytes"]),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(limit, (value, value))
    cpu_seconds = settings["cpu_seconds"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))


def _die_with_parent(libc, parent_pid: int | None) -> None:
    """SIGKILL when the thread that started this process ends (Linux); if `parent_pid` is given and
    that process has already ended, end now (the signal would never come)."""
    if libc is None or not sys.platform.startswith("linux"):
        return
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)


def _unshare(libc) -> tuple[str, ...]:
    """The namespaces this process now has of its own: ('user', 'network', 'pid'), ('network', 'pid')
    or () where the kernel refuses both."""
    if libc is None or not sys.platform.startswith("linux"):
        return ()
    if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET | _CLONE_NEWPID) == 0:
        return ("user", "network", "pid")
    if libc.unshare(_CLONE_NEWNET | _CLONE_NEWPID) == 0:
        return ("network", "pid")
    return ()


def _blocked(what: str):
    def refuse(*args, **kwargs):
        raise SandboxViolation(f"batchgen code sandbox: {what} is not allowed")

    return refuse


def _blocked_class(base: type, what: str) -> type:
    """A subclass of `base` that cannot be instantiated: modules that subclass `base` at import (ssl
    subclasses socket.socket) still import."""
    return type(base.__name__, (base,), {"__init__": _blocked(what), "__module__": base.__module__})


def install_guards() -> None:
    """Replace socket and process creation with functions that raise SandboxViolation."""
    import _posixsubprocess
    import _socket
    import socket
    import subprocess

    socket.socket = _blocked_class(socket.socket, "opening a socket")
    _socket.socket = _blocked_class(_socket.socket, "opening a socket")
    for name in ("create_connection", "create_server", "socketpair", "fromfd"):
        setattr(socket, name, _blocked(f"socket.{name}"))
    _socket.socketpair = _blocked("socket.socketpair")
    subprocess.Popen = _blocked_class(subprocess.Popen, "starting a process (subprocess)")
    _posixsubprocess.fork_exec = _blocked("starting a process (fork_exec)")
    for name in ("fork", "forkpty", "system", "popen", "posix_spawn", "posix_spawnp",
                 "execv", "execve", "execl", "execle", "execlp", "execlpe", "execvp", "execvpe",
                 "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe"):
        if hasattr(os, name):
            setattr(os, name, _blocked(f"starting a process (os.{name})"))


def _print_error(error: BaseException, program_path: str) -> None:
    """The error's traceback on stderr from the program's first frame (as `python program.py` prints
    it, without this script's and runpy's frames), or its type alone when memory is short (the
    program's objects are still held by the traceback's frames)."""
    frames = error.__traceback__
    while frames is not None and frames.tb_frame.f_code.co_filename != program_path:
        frames = frames.tb_next
    try:
        traceback.print_exception(type(error), error, frames)
    except MemoryError:
        os.write(2, f"{type(error).__name__}\n".encode())


def run(program_path: str) -> int:
    """Run the program as `python program_path` would: as __main__, its folder first on sys.path, an
    uncaught exception printed; its exit status (SystemExit passes through)."""
    sys.argv = [program_path]
    sys.path.insert(0, os.path.dirname(program_path))
    try:
        runpy.run_path(program_path, run_name="__main__")
    except MemoryError as error:
        _print_error(error, program_path)
        return EXIT_MEMORY
    except Exception as error:  # noqa: BLE001 - the program's failure, printed as Python would (SystemExit passes)
        _print_error(error, program_path)
        return EXIT_FORBIDDEN if _is_caused_by_guard(error) else 1
    return 0


def _is_caused_by_guard(error: BaseException) -> bool:
    """Whether a guard's SandboxViolation is the error or behind it (urllib wraps it in a URLError)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, SandboxViolation):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def _end_as(status: int) -> None:
    """End this process the way a child with wait status `status` ended: its exit status, or its signal."""
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)
        os._exit(128 + number)  # a signal that does not end a process
    os._exit(os.waitstatus_to_exitcode(status))


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:  # ended meanwhile
        pass


def _enter_pid_namespace(libc) -> None:
    """Fork twice after unshare(CLONE_NEWPID): this process waits outside the namespace; its child is
    the namespace's init (PID 1), whose end makes the kernel kill every process left in the namespace;
    the init's child returns from here to run the program as PID 2, where signals behave as usual (an
    init ignores those it has no handler for, SIGXCPU included). The program's wait status travels from
    the init to this process through a pipe, since an init cannot end itself by a signal. SIGTERM to
    this process (code_exec at the time limit) kills the init, and so the namespace, and this process
    reaps it before it ends: no orphan is left for the system's init to reap."""
    status_read, status_write = os.pipe()
    init_pid = os.fork()
    if init_pid != 0:  # outside
        signal.signal(signal.SIGTERM, lambda number, frame: _kill(init_pid))
        os.close(status_write)
        _, init_status = os.waitpid(init_pid, 0)
        program_status = os.read(status_read, 32)
        _end_as(int(program_status) if program_status else init_status)
    os.close(status_read)
    _die_with_parent(libc, None)  # its parent is outside the namespace: getppid() reads 0
    program_pid = os.fork()
    if program_pid != 0:  # the init
        _, program_status = os.waitpid(program_pid, 0)
        os.write(status_write, str(program_status).encode())
        os._exit(0)
    os.close(status_write)
    _die_with_parent(libc, None)


def main(argv: list[str]) -> None:
    settings, program_path = json.loads(argv[1]), argv[2]
    if settings.get("probe"):  # code_exec.probe_isolation: report the layers, run nothing
        _set_limits(settings)
        print(json.dumps({"namespaces": list(_unshare(_libc()))}))
        return
    libc = _libc()
    _die_with_parent(libc, settings["parent_pid"])
    _set_limits(settings)
    namespaces = _unshare(libc)
    if "pid" in namespaces:
        _enter_pid_namespace(libc)
    if "user" in namespaces:
        resource.setrlimit(resource.RLIMIT_NPROC, (MAX_TASKS, MAX_TASKS))
    install_guards()
    sys.exit(run(program_path))


if __name__ == "__main__":
    main(sys.argv)
