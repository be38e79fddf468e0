"""pyproject.toml lists every subpackage and data file: a non-editable install (a wheel) ships only those listed."""

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


def test_every_data_file_the_code_reads_is_package_data():
    """Files beside the code that it opens at run time (C sources, the calibration text)."""
    options = read_configuration(ROOT / "pyproject.toml")["tool"]["setuptools"]
    data = options["package-data"]
    folders = options["package-dir"]

    def listed(package: str, folder: Path) -> set[Path]:
        return {p for pattern in data.get(package, []) for p in folder.glob(pattern)}

    shipped = set()
    for name, folder in folders.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            package = ".".join([name, *init.parent.relative_to(ROOT / folder).parts])
            shipped |= listed(package, init.parent)
    needed = {*(ROOT / "kernels" / "csrc").glob("*.c"), ROOT / "engine" / "quant" / "calibrate" / "calibration_text.txt",
              *(ROOT / "report" / "templates").glob("*.j2")}
    assert needed - shipped == set(), "missing from [tool.setuptools.package-data]"
