"""bench -> pipeline, engine: nothing in engine, pipeline or kernels imports batchgen.bench, except the
`batchgen` command line, which registers the `bench` command."""

from __future__ import annotations

import ast
from pathlib import Path

import batchgen.engine
import batchgen.kernels
import batchgen.pipeline

ALLOWED = {("pipeline", "cli.py")}  # `batchgen bench` is a subcommand of the one console script


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_no_package_below_bench_imports_it():
    offenders = []
    for package in (batchgen.engine, batchgen.pipeline, batchgen.kernels):
        root = Path(package.__file__).resolve().parent
        for path in sorted(root.rglob("*.py")):
            if (root.name, path.name) in ALLOWED:
                continue
            if any(m == "batchgen.bench" or m.startswith("batchgen.bench.") for m in imported_modules(path)):
                offenders.append(str(path.relative_to(root.parent)))
    assert offenders == []


def test_the_allowed_exception_is_still_needed():
    cli = Path(batchgen.pipeline.__file__).resolve().parent / "cli.py"
    assert "batchgen.bench.cli" in imported_modules(cli)
