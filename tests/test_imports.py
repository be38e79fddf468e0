"""batchgen's import graph, read from every module's source (absolute, relative and function-level imports):

- no import cycle between any two modules, nor a module importing itself: the strongly connected
  components of the module graph are single modules. Every import counts, those inside a function
  too (a lazy import runs later, but the two modules still need each other); only imports under
  `if TYPE_CHECKING:` do not, as they never run.
- the packages import in one direction:

      cli -> bench -> serve, report -> pipeline -> openai -> engine -> kernels
      (serve: openai, engine, kernels, never pipeline; report: pipeline, engine, kernels)

  with config_docs (the field-docstring reader, standard library only) below them all;

  lazy and annotation-only imports obey it too; `batchgen/__init__.py` (the public face) imports the
  engine alone, lazily.
- inside the engine, the runtime loads the offline calibration (engine/quant/calibrate/) only from
  inside a function (it runs at load, on request);
- outside pipeline/output/, code uses the output-folder layer through its API (its __init__) only.

An import `import a.b` is an edge to a.b; `from a.b import c` to a.b, and to a.b.c when that is a
module. The parent packages Python imports on the way are not edges.
"""

from __future__ import annotations

import ast
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "src" / "batchgen"
PACKAGE = "batchgen"
PACKAGES = ("kernels", "engine", "metrics", "openai", "pipeline", "serve", "report", "bench", "cli")
TOP = "batchgen"  # batchgen/__init__.py, in the direction table
# Top-level modules below every package: the config field-docstring reader (stdlib only), which the
# engine's, the job's and the server's configs and the CLI all read.
LEAF_MODULES = ("config_docs",)

# package -> the packages it may import (itself always allowed), at import time, lazily or for annotations
ALLOWED = {
    TOP: {"engine"},
    "config_docs": set(),
    "kernels": set(),
    "engine": {"kernels", *LEAF_MODULES},
    "metrics": set(),  # eval metrics: numpy, pyarrow and pydantic only, for jobs, the report and the CLI
    "openai": {"engine", "kernels", *LEAF_MODULES},
    "pipeline": {"metrics", "openai", "engine", "kernels", *LEAF_MODULES},
    "serve": {"metrics", "openai", "engine", "kernels", *LEAF_MODULES},
    "report": {"metrics", "pipeline", "engine", "kernels", *LEAF_MODULES},
    "bench": {TOP, "serve", "report", "metrics", "openai", "pipeline", "engine", "kernels", *LEAF_MODULES},
    "cli": {TOP, "bench", "serve", "report", "metrics", "openai", "pipeline", "engine", "kernels", *LEAF_MODULES},
}
CALIBRATION = "batchgen.engine.quant.calibrate"
OUTPUT_LAYER = "batchgen.pipeline.output"


@dataclass(frozen=True)
class Import:
    module: str  # importing module, e.g. batchgen.pipeline.job
    target: str  # what it names, e.g. batchgen.engine.llm (a module, or a name inside one)
    line: int
    is_lazy: bool  # inside a function body: loaded when that code first runs
    is_type_only: bool  # under `if TYPE_CHECKING:`: never loaded at run time


def module_name(path: Path, root: Path = ROOT, package: str = PACKAGE) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def resolve(node: ast.ImportFrom, module: str, is_package: bool) -> tuple[str, list[str]]:
    """(the module `from X import ...` reads, X.name for each imported name), X resolved against
    `module` when relative."""
    if node.level == 0:
        base = node.module or ""
    else:
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([node.module] if node.module else []))
    return base, [f"{base}.{alias.name}" for alias in node.names]


def _is_type_checking(test: ast.expr) -> bool:
    """`if TYPE_CHECKING:` or `if typing.TYPE_CHECKING:`."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(path: Path, root: Path = ROOT, package: str = PACKAGE) -> list[Import]:
    """Every import of `package` modules that the module at `path` makes, wherever it sits."""
    module = module_name(path, root, package)
    is_package = path.name == "__init__.py"
    found: list[Import] = []

    def visit(nodes, is_lazy: bool, is_type_only: bool) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base, names = resolve(node, module, is_package)
                targets = [base, *names]
            else:
                targets = []
            found.extend(Import(module, target, node.lineno, is_lazy, is_type_only) for target in targets)
            if isinstance(node, ast.If) and _is_type_checking(node.test):
                visit(node.body, is_lazy, True)
                visit(node.orelse, is_lazy, is_type_only)
            else:
                is_function = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                visit(ast.iter_child_nodes(node), is_lazy or is_function, is_type_only)

    visit([ast.parse(path.read_text(), str(path))], False, False)
    return [i for i in found if i.target == package or i.target.startswith(package + ".")]


def find_modules(root: Path, package: str) -> dict[str, Path]:
    """Every module of the package rooted at the folder `root`: dotted name -> file."""
    return {module_name(path, root, package): path for path in sorted(root.rglob("*.py"))}


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, dict[str, Import]]:
    """module -> {module it imports: the first such import}, over the runtime imports (lazy ones included,
    `if TYPE_CHECKING:` ones not) of the package rooted at the folder `root`. A package's __init__ naming
    one of its own submodules (`from . import sub`) reads itself only on the way: no self-edge then."""
    modules = find_modules(root, package)
    graph: dict[str, dict[str, Import]] = {name: {} for name in modules}
    for name, path in modules.items():
        imports = imports_of(path, root, package)
        for imp in imports:
            if imp.is_type_only or imp.target not in modules or imp.target in graph[name]:
                continue
            if imp.target == name and _names_own_submodules(imp, imports, modules):
                continue
            graph[name][imp.target] = imp
    return graph


def _names_own_submodules(imp: Import, imports: list[Import], modules: dict[str, Path]) -> bool:
    """`from <this package> import sub, ...` in a package's __init__: the statement's other targets (one
    statement per line) are all submodules."""
    names = [i.target for i in imports if i.line == imp.line and i.target != imp.target]
    return bool(names) and all(name in modules for name in names)


def strongly_connected_components(graph: dict[str, dict[str, Import]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (no recursion limit for deep graphs); components in reverse
    topological order, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(graph[nxt])))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
    return components


def shortest_cycle(graph: dict[str, dict[str, Import]], start: str, within: set[str]) -> list[str]:
    """The shortest import path from `start` back to itself through the modules `within` (breadth first):
    [start, ..., start]."""
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(graph[node]):
            if nxt not in within:
                continue
            if nxt == start:
                path = [node]  # back from the last step to start
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if nxt not in came_from:
                came_from[nxt] = node
                queue.append(nxt)
    raise ValueError(f"{start} is on no cycle within {sorted(within)}")


def find_cycles(graph: dict[str, dict[str, Import]]) -> list[list[str]]:
    """Import cycles as paths [a, b, ..., a]: for every strongly connected component of more than one
    module, shortest cycles until each of its modules is on one; every self-import as [a, a]."""
    cycles = []
    for component in strongly_connected_components(graph):
        within = set(component)
        if len(component) == 1:
            if component[0] in graph[component[0]]:
                cycles.append([component[0], component[0]])
            continue
        covered: set[str] = set()
        for module in component:
            if module not in covered:
                cycle = shortest_cycle(graph, module, within)
                covered.update(cycle)
                cycles.append(cycle)
    return sorted(cycles)


def describe_cycle(graph: dict[str, dict[str, Import]], cycle: list[str], root: Path = ROOT,
                   package: str = PACKAGE) -> str:
    """`a -> b -> a`, then the import line that makes each step (one of them is the one to cut)."""
    lines = [" -> ".join(cycle)]
    modules = find_modules(root, package)
    for a, b in zip(cycle, cycle[1:]):
        imp = graph[a][b]
        where = modules[a].relative_to(root.parent)
        kind = " (inside a function)" if imp.is_lazy else ""
        lines.append(f"    {where}:{imp.line}{kind} imports {b}")
    return "\n".join(lines)


def package_of(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else TOP


def all_imports() -> list[Import]:
    return [imp for path in sorted(ROOT.rglob("*.py")) for imp in imports_of(path)]


IMPORTS = all_imports()
GRAPH = import_graph()


def test_no_import_cycle_between_modules():
    cycles = find_cycles(GRAPH)
    assert not cycles, ("import cycles; cut one import of each (move the name it reads to a module below\n"
                        "both, pass the object in, or, if only annotations need it, import it under\n"
                        "TYPE_CHECKING):\n" + "\n".join(describe_cycle(GRAPH, cycle) for cycle in cycles))


def test_the_cycle_finder_reports_exactly_the_real_cycle(tmp_path):
    """A scratch package: a -> b -> (lazily) c -> a is a cycle; d <-> e only through `if TYPE_CHECKING:`
    is not; f's __init__ imports its own submodule (no self-import); g imports a (no cycle)."""
    root = tmp_path / "scratch"
    sources = {
        "__init__.py": "",
        "a.py": "from scratch import b\n",
        "b.py": "def load():\n    from .c import VALUE\n    return VALUE\n",
        "c.py": "import scratch.a\nVALUE = 1\n",
        "d.py": "from scratch.e import E\n",
        "e.py": ("from __future__ import annotations\nimport typing\nfrom typing import TYPE_CHECKING\n"
                 "if TYPE_CHECKING:\n    from scratch.d import D\n"
                 "if typing.TYPE_CHECKING:\n    import scratch.d\nE = 1\n"),
        "f/__init__.py": "from scratch.f import inner\nfrom . import inner as again\n",
        "f/inner.py": "X = 1\n",
        "g.py": "from scratch.a import b\n",
    }
    for name, text in sources.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    graph = import_graph(root, "scratch")
    assert set(graph["scratch.b"]) == {"scratch.c"}  # the lazy import is an edge
    assert set(graph["scratch.e"]) == set()  # the TYPE_CHECKING ones are not
    assert find_cycles(graph) == [["scratch.a", "scratch.b", "scratch.c", "scratch.a"]]
    message = describe_cycle(graph, find_cycles(graph)[0], root, "scratch")
    assert message.splitlines() == ["scratch.a -> scratch.b -> scratch.c -> scratch.a",
                                    "    scratch/a.py:1 imports scratch.b",
                                    "    scratch/b.py:2 (inside a function) imports scratch.c",
                                    "    scratch/c.py:1 imports scratch.a"]


def test_the_cycle_finder_reports_a_self_import_and_every_module_of_a_knot(tmp_path):
    """A module importing itself is a cycle; a component of four modules (two cycles sharing one module)
    is reported with every member on a listed cycle."""
    root = tmp_path / "knot"
    sources = {"__init__.py": "", "me.py": "import knot.me\n", "hub.py": "from knot import left, right\n",
               "left.py": "import knot.hub\n", "right.py": "from knot.tail import T\n",
               "tail.py": "import knot.hub\nT = 1\n"}
    for name, text in sources.items():
        root.mkdir(exist_ok=True)
        (root / name).write_text(text)
    graph = import_graph(root, "knot")
    cycles = find_cycles(graph)
    assert ["knot.me", "knot.me"] in cycles
    # `from knot import left` also reads knot/__init__.py, which imports nothing here
    assert [c for c in cycles if c[0] != "knot.me"] == [["knot.hub", "knot.left", "knot.hub"],
                                                        ["knot.right", "knot.tail", "knot.hub", "knot.right"]]


def test_tarjan_handles_a_chain_deeper_than_the_recursion_limit():
    depth = sys.getrecursionlimit() + 100
    graph = {f"m{i}": ({f"m{i + 1}": None} if i + 1 < depth else {"m0": None}) for i in range(depth)}
    components = strongly_connected_components(graph)
    assert len(components) == 1 and len(components[0]) == depth
    del graph[f"m{depth - 1}"]["m0"]
    assert len(strongly_connected_components(graph)) == depth


def test_every_top_level_package_has_a_direction():
    found = {path.name for path in ROOT.iterdir() if (path / "__init__.py").exists()}
    modules = {path.stem for path in ROOT.glob("*.py")} - {"__init__"}
    assert found == set(PACKAGES) and modules == set(LEAF_MODULES)


def test_the_direction_table_has_no_cycle():
    """The rules themselves are one order (else two packages could lean on each other within the rules)."""
    graph = {package: {other: None for other in allowed} for package, allowed in ALLOWED.items()}
    assert [c for c in strongly_connected_components(graph) if len(c) > 1] == []


@pytest.mark.parametrize("package", [TOP, *LEAF_MODULES, *PACKAGES])
def test_each_package_imports_only_below_it(package):
    offenders = {}  # (module, line) -> the statement's first target (`from X import y` also names X.y)
    for imp in IMPORTS:
        if package_of(imp.module) != package:
            continue
        target = package_of(imp.target)
        if target != package and target not in ALLOWED[package]:
            kind = " (lazy)" if imp.is_lazy else " (TYPE_CHECKING)" if imp.is_type_only else ""
            offenders.setdefault((imp.module, imp.line), f"{imp.module}:{imp.line} -> {imp.target}{kind}")
    allowed = sorted(ALLOWED[package])
    assert not offenders, f"{package} may import only {allowed}:\n" + "\n".join(offenders.values())


def test_the_top_level_package_loads_the_engine_only_on_demand():
    """`import batchgen` (the package every `batchgen.X` import runs first) does not pay for torch."""
    eager = [f"{i.target}:{i.line}" for i in IMPORTS
             if i.module == PACKAGE and not (i.is_lazy or i.is_type_only)]
    assert eager == []


def test_the_engine_runtime_loads_calibration_only_on_demand():
    offenders = [f"{i.module}:{i.line} -> {i.target}" for i in IMPORTS
                 if package_of(i.module) == "engine" and not i.module.startswith(CALIBRATION)
                 and i.target.startswith(CALIBRATION) and not (i.is_lazy or i.is_type_only)]
    assert offenders == []


def test_the_reader_sees_every_import_form(tmp_path):
    """The checks above would pass vacuously if relative, lazy or TYPE_CHECKING imports were misread."""
    pkg = tmp_path / "engine" / "sub"
    pkg.mkdir(parents=True)
    source = pkg / "mod.py"
    source.write_text("from typing import TYPE_CHECKING\nfrom ..llm import LLM\nfrom . import sibling\n\n"
                      "if TYPE_CHECKING:\n    from batchgen.serve.app import App\n"
                      "else:\n    import batchgen.openai\n\n"
                      "def f():\n    import batchgen.pipeline.job\n")
    found = {(i.target, i.is_lazy, i.is_type_only) for i in imports_of(source, tmp_path)}
    assert ("batchgen.engine.llm", False, False) in found
    assert ("batchgen.engine.llm.LLM", False, False) in found
    assert ("batchgen.engine.sub.sibling", False, False) in found
    assert ("batchgen.serve.app", False, True) in found
    assert ("batchgen.openai", False, False) in found  # the else branch runs
    assert ("batchgen.pipeline.job", True, False) in found


def test_the_output_folder_layer_is_used_through_its_api_only():
    """Outside pipeline/output/, code imports `batchgen.pipeline.output` (its __init__), never its modules."""
    offenders = [f"{i.module}:{i.line} -> {i.target}" for i in IMPORTS
                 if not i.module.startswith(OUTPUT_LAYER) and _is_submodule(i.target, OUTPUT_LAYER)]
    assert offenders == []


def _is_submodule(target: str, layer: str) -> bool:
    """`batchgen.pipeline.output.lock` is a module of the layer; `batchgen.pipeline.output.open_run` (a name
    imported from its __init__, as the reader records `from X import name` as X.name too) is not."""
    if not target.startswith(layer + "."):
        return False
    name = target.removeprefix(layer + ".").split(".")[0]
    return (ROOT / "pipeline" / "output" / f"{name}.py").exists()
