"""The packages' import direction, read from every module's source (absolute and relative imports):

    cli -> {bench, serve, report, pipeline}; bench -> serve, report, pipeline; report -> pipeline;
    pipeline, serve -> openai -> engine -> kernels; config_docs (standard library only) under all of them

- kernels import nothing of batchgen's;
- engine imports only engine and kernels; inside it, the runtime imports the offline calibration
  (engine/quant/calibrate/) only from inside a function (it runs at load, on request);
- no product package (pipeline, serve, report, bench, openai, engine) imports the command line, and
  serve imports no pipeline module, not even from inside a function;
- no cycle between packages among the imports made at import time.
"""

from __future__ import annotations

import ast
import itertools
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "src" / "batchgen"
PACKAGES = ("kernels", "engine", "openai", "pipeline", "serve", "bench", "report", "cli")

# package -> the packages it may import at import time (itself and the LEAVES always allowed)
ALLOWED = {
    "kernels": set(),
    "engine": {"kernels"},
    "openai": {"engine", "kernels"},
    "pipeline": {"openai", "engine", "kernels"},
    "serve": {"openai", "engine", "kernels"},
    "report": {"pipeline", "engine", "kernels"},
    "bench": {"serve", "report", "openai", "pipeline", "engine", "kernels"},
    "cli": {"bench", "serve", "report", "openai", "pipeline", "engine", "kernels"},
}
# ... and from inside a function (a lazy import: loaded only when that code runs): the same
ALLOWED_LAZY = ALLOWED
# Modules at the package's root that import nothing of batchgen's: every package may use them.
LEAVES = ("config_docs",)
CALIBRATION = "batchgen.engine.quant.calibrate"


@dataclass(frozen=True)
class Import:
    module: str  # importing module, e.g. batchgen.pipeline.job
    target: str  # imported module, e.g. batchgen.engine.llm
    is_lazy: bool  # inside a function body


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["batchgen", *parts])


def resolve(node: ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The absolute module names an ImportFrom reads (a relative one resolved against `module`)."""
    if node.level == 0:
        base = node.module or ""
    else:
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([node.module] if node.module else []))
    # `from batchgen.pipeline import cli` imports the submodule batchgen.cli.main
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def imports_of(path: Path, root: Path = ROOT) -> list[Import]:
    module = module_name(path, root)
    tree = ast.parse(path.read_text(), str(path))
    found = []

    def visit(node: ast.AST, is_lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            lazy = is_lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend(Import(module, alias.name, is_lazy) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                names = resolve(child, module, path.name == "__init__.py")
                found.extend(Import(module, name, is_lazy) for name in names)
            visit(child, lazy)

    visit(tree, False)
    return [i for i in found if i.target.startswith("batchgen.")]


def package_of(name: str) -> str:
    return name.split(".")[1]


def all_imports() -> list[Import]:
    result = []
    for package in PACKAGES:
        folder = ROOT / package
        for path in sorted(folder.rglob("*.py")) if folder.is_dir() else []:
            result.extend(imports_of(path))
    return result


IMPORTS = all_imports()


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_imports_only_below_it(package):
    offenders = []
    for imp in IMPORTS:
        if package_of(imp.module) != package:
            continue
        target = package_of(imp.target)
        allowed = (ALLOWED_LAZY if imp.is_lazy else ALLOWED)[package] | {package, *LEAVES}
        if target not in allowed:
            offenders.append(f"{imp.module} -> {imp.target}" + (" (lazy)" if imp.is_lazy else ""))
    assert offenders == []


@pytest.mark.parametrize("leaf", LEAVES)
def test_the_leaves_import_nothing_of_batchgen(leaf):
    assert imports_of(ROOT / f"{leaf}.py") == []


def test_the_engine_runtime_loads_calibration_only_on_demand():
    offenders = [f"{i.module} -> {i.target}" for i in IMPORTS
                 if package_of(i.module) == "engine" and not i.module.startswith(CALIBRATION)
                 and i.target.startswith(CALIBRATION) and not i.is_lazy]
    assert offenders == []


def test_no_cycle_between_packages_at_import_time():
    edges = {(package_of(i.module), package_of(i.target)) for i in IMPORTS if not i.is_lazy}
    edges = {(a, b) for a, b in edges if a != b and b not in LEAVES}  # a leaf imports nothing back
    reach = {p: {b for a, b in edges if a == p} for p in PACKAGES}
    for _ in PACKAGES:  # transitive closure
        for p in PACKAGES:
            reach[p] |= set(itertools.chain.from_iterable(reach[q] for q in reach[p]))
    assert [p for p in PACKAGES if p in reach[p]] == []


def test_the_reader_sees_both_import_forms(tmp_path):
    """The checks above would pass vacuously if relative or lazy imports were missed."""
    pkg = tmp_path / "engine" / "sub"
    pkg.mkdir(parents=True)
    source = pkg / "mod.py"
    source.write_text("from ..llm import LLM\nfrom . import sibling\n\ndef f():\n    import batchgen.pipeline.job\n")
    found = {(i.target, i.is_lazy) for i in imports_of(source, tmp_path)}
    assert ("batchgen.engine.llm", False) in found
    assert ("batchgen.engine.sub.sibling", False) in found
    assert ("batchgen.pipeline.job", True) in found


def test_the_output_folder_layer_is_used_through_its_api_only():
    """Outside pipeline/output/, code imports `batchgen.pipeline.output` (its __init__), never its modules."""
    layer = "batchgen.pipeline.output"
    offenders = [f"{i.module} -> {i.target}" for i in IMPORTS
                 if not i.module.startswith(layer) and _is_submodule(i.target, layer)]
    assert offenders == []


def _is_submodule(target: str, layer: str) -> bool:
    """`batchgen.pipeline.output.lock` is a module of the layer; `batchgen.pipeline.output.open_run` (a name
    imported from its __init__, as the reader records `from X import name` as X.name too) is not."""
    if not target.startswith(layer + "."):
        return False
    name = target.removeprefix(layer + ".").split(".")[0]
    return (ROOT / "pipeline" / "output" / f"{name}.py").exists()
