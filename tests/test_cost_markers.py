"""The costly kinds' markers: the guard's reading of a child's command line (tests/cost_markers.py), and
the fast tier (`make test-fast`) leaving out exactly the registered kinds."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.cost_markers import COSTLY_KINDS, kind_of_command

ROOT = Path(__file__).resolve().parents[1]
RAY = "/venv/lib/python3.11/site-packages/ray"


@pytest.mark.parametrize("command, kind", [
    ([sys.executable, "-m", "batchgen.cli.main", "serve", "smollm2-135m-instruct", "--port", "8000"], "server"),
    ([sys.executable, "-m", "batchgen.cli.main", "run", "job.yaml"], "subprocess"),
    ([sys.executable, "-c", "print(1)"], "subprocess"),
    (["python3", "-m", "pip", "wheel", "."], "subprocess"),
    ("python -c 'import batchgen'", "subprocess"),
    (["/usr/bin/chromium", "--headless=new", "--remote-debugging-port=0"], "browser"),
    ([f"{RAY}/core/src/ray/gcs/gcs_server", "--gcs_server_port=0"], "ray"),
    ([sys.executable, "-u", f"{RAY}/_private/workers/default_worker.py"], "ray"),
    ([Path("/usr/bin/gcc"), "-O2", "-shared", "paged_decode.c"], None),  # the C kernels' build
    (["objdump", "-d", "libpaged.so"], None),
])
def test_a_child_process_is_of_the_kind_its_command_line_says(command, kind):
    assert kind_of_command(command) == kind


def test_the_fast_tier_leaves_out_every_registered_costly_kind():
    markers = re.search(r"^markers = \[\n(.*?)^\]", (ROOT / "pyproject.toml").read_text(), re.M | re.S)[1]
    registered = re.findall(r'^    "(\w+)[(:]', markers, re.M)
    assert set(COSTLY_KINDS) < set(registered)
    fast_tier = re.search(r"^FAST_TIER := not \((.*)\)$", (ROOT / "Makefile").read_text(), re.M)[1]
    assert fast_tier.split(" or ") == registered
    assert f'-m "not ({fast_tier})"' in (ROOT / "docs" / "development.md").read_text()


@pytest.mark.subprocess
def test_the_guard_fails_a_test_that_starts_a_process_without_its_marker(pytester, monkeypatch):
    """End to end, in a pytest of its own with the guard loaded: the same child process passes under the
    marker and fails without it, naming the marker to add."""
    pytester.makepyfile(test_children="""
        import subprocess, sys
        import pytest

        def test_unmarked():
            subprocess.run([sys.executable, "-c", "pass"], check=True)

        @pytest.mark.subprocess
        def test_marked():
            subprocess.run([sys.executable, "-c", "pass"], check=True)
    """)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the child pytest imports tests.cost_markers
    result = pytester.runpytest_subprocess("-p", "tests.cost_markers", "-W", "ignore::pytest.PytestUnknownMarkWarning")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*test_unmarked*", "*did costly work without its marker: subprocess*"])
