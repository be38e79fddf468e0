"""The package is found by setuptools from src/: every folder of modules is a package, and a wheel holds
every module and every data file beside the code (C sources, templates, the calibration text)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.subprocess

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGE = REPO_ROOT / "src" / "batchgen"
SHIPPED_SUFFIXES = {".py", ".c", ".h", ".j2", ".txt", ".sh"}


def test_every_folder_of_modules_is_a_package():
    folders = {p.parent for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}
    assert sorted(str(f.relative_to(PACKAGE)) for f in folders if not (f / "__init__.py").exists()) == []


def test_a_wheel_holds_the_whole_package_and_nothing_else(tmp_path):
    """Built from a clean copy of the sources: setuptools reuses a checkout's ignored build/ folder, which
    keeps modules deleted since, so a wheel built in place can ship code the tree no longer has."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, source / name)
    shutil.copytree(PACKAGE, source / "src" / "batchgen", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(source)], check=True, timeout=600)
    (wheel,) = tmp_path.glob("batchgen-*.whl")
    in_wheel = {name for name in zipfile.ZipFile(wheel).namelist() if name.startswith("batchgen/")}
    on_disk = {str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*")
               if p.is_file() and p.suffix in SHIPPED_SUFFIXES and "__pycache__" not in p.parts}
    assert {"batchgen/__init__.py", "batchgen/kernels/csrc/paged_decode.c",
            "batchgen/report/templates/report.html.j2"} <= on_disk
    assert sorted(on_disk - in_wheel) == []
    assert sorted(in_wheel - on_disk) == []
