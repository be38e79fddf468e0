"""The costly kinds of test, and a guard that fails a test which does a costly thing without its marker.

The markers are registered in pyproject.toml ([tool.pytest.ini_options] markers) and put on tests by hand
(module-level `pytestmark` or a decorator) so that a reader sees them; docs/development.md says how to run
the fast tier. This guard keeps them honest: while a test sets up and runs, it watches for the child
processes it starts (`subprocess.Popen`, `multiprocessing` processes) and for Triton kernel launches under
the interpreter, and fails the test if it lacks the marker of what it did (a plain Python child is
allowed to a test already marked with another process kind). Work done by a module or
session fixture counts for the test that set it up first, which is the one that pays for it; a test
that only reuses it is caught when it runs without that test (as in the fast tier).
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
import sys

import pytest

# What this guard watches for; `slow` (registered beside them) is put on by hand from --durations.
COSTLY_KINDS = ("server", "ray", "browser", "triton", "subprocess")
# A test of one of these kinds may also start a plain Python child without the `subprocess` marker (a
# library's own, such as lm-eval's `pip list`): it is out of the fast tier already.
PROCESS_KINDS = {"server", "ray", "browser", "subprocess"}

_seen: dict[str, str] = {}  # kind -> one example (a command line or a kernel name) in the current test


def kind_of_command(args) -> str | None:
    """The costly kind of a child process, from its command line; None for other tools (a C compiler, git)."""
    argv = [os.fsdecode(a) for a in args] if isinstance(args, (list, tuple)) else [os.fsdecode(args)]
    if any(f"{os.sep}ray{os.sep}" in a for a in argv[:3]):
        return "ray"  # its GCS and raylet binaries, and the scripts of its Python processes: in the ray package
    program = os.path.basename(argv[0].split()[0]) if argv and argv[0] else ""
    if "chrom" in program:
        return "browser"
    if program.startswith("python") or argv[0] == sys.executable:
        return "server" if "batchgen.cli.main" in argv and "serve" in argv else "subprocess"
    return None


def _record(kind: str | None, example: str) -> None:
    if kind is not None:
        _seen.setdefault(kind, example[:200])


_popen_init = subprocess.Popen.__init__


def _watched_popen_init(self, args, *rest, **kwargs):
    try:
        _record(kind_of_command(args), " ".join(map(str, args)) if isinstance(args, (list, tuple)) else str(args))
    except (TypeError, ValueError, IndexError):  # a command line this reading does not know: Popen judges it
        pass
    _popen_init(self, args, *rest, **kwargs)


_process_start = multiprocessing.process.BaseProcess.start


def _watched_process_start(self):
    _record("subprocess", f"multiprocessing process {self.name}")
    _process_start(self)


def _watch_triton_launches() -> None:
    """Wrap the interpreter's kernel launch once triton's interpreter is loaded (a `triton.jit` kernel
    under TRITON_INTERPRET=1 loads it when it is defined, so at a test module's import)."""
    interpreter = sys.modules.get("triton.runtime.interpreter")
    grid_executor = getattr(interpreter, "GridExecutor", None)
    if grid_executor is None or getattr(grid_executor.__call__, "is_watched", False):
        return
    launch = grid_executor.__call__

    def watched_launch(self, *args, **kwargs):
        _record("triton", getattr(self.fn, "__name__", "a kernel"))
        return launch(self, *args, **kwargs)

    watched_launch.is_watched = True
    grid_executor.__call__ = watched_launch


def pytest_configure(config):
    subprocess.Popen.__init__ = _watched_popen_init
    multiprocessing.process.BaseProcess.start = _watched_process_start


def pytest_unconfigure(config):
    subprocess.Popen.__init__ = _popen_init
    multiprocessing.process.BaseProcess.start = _process_start


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _watch_triton_launches()
    _seen.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when != "call" or not report.passed:
        return
    markers = {mark.name for mark in item.iter_markers()}
    missing = {kind: example for kind, example in _seen.items()
               if kind not in markers and not (kind == "subprocess" and markers & PROCESS_KINDS)}
    if missing:
        report.outcome = "failed"
        report.longrepr = ("this test (or a fixture it set up) did costly work without its marker: "
                           + "; ".join(f"{kind}: {example}" for kind, example in sorted(missing.items()))
                           + ". Add @pytest.mark.<kind> (or the module's pytestmark): see docs/development.md.")
