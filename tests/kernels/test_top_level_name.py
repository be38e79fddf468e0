"""transformers >= 5.25 imports Hugging Face's `kernels` distribution by that name whenever it is installed.
batchgen's kernels live at batchgen.kernels under src/, so run from the checkout's root (as pytest and
`python -m` are) a top-level `import kernels` finds the installed package, never this one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.subprocess

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_a_top_level_kernels_import_from_the_checkout_gets_the_installed_package(tmp_path):
    installed = tmp_path / "site" / "kernels"
    installed.mkdir(parents=True)
    (installed / "__init__.py").write_text('CUDAProperties = "the installed kernels"\n')
    script = ("from kernels import CUDAProperties; import batchgen.kernels.cpu_isa as isa, batchgen.kernels as ours; "
              "print(CUDAProperties); print(ours.__name__, callable(isa.selected_isa))")
    path = os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])
    child = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": path},
                           capture_output=True, text=True, timeout=120, check=False)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split("\n")[:2] == ["the installed kernels", "batchgen.kernels True"]
