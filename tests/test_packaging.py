"""pyproject.toml lists every subpackage: a non-editable install (a wheel) ships only those listed."""

from __future__ import annotations

from pathlib import Path

from setuptools.config.pyprojecttoml import read_configuration

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed():
    options = read_configuration(ROOT / "pyproject.toml")["tool"]["setuptools"]
    on_disk = set()
    for name, folder in options["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder)
            on_disk.add(".".join([name, *relative.parts]))
    assert on_disk - set(options["packages"]) == set(), "missing from [tool.setuptools] packages"
    assert set(options["packages"]) - on_disk == set(), "listed but not on disk"
