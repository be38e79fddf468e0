"""Refuse tensor parallelism from a script's unguarded top level before any worker starts.

The workers start with multiprocessing's spawn (fork is unsafe once torch's thread pools run), and
spawn imports the caller's main module again in each worker: a script that builds the engine at its
top level, outside `if __name__ == "__main__":`, would build it again in every worker. vLLM forks
where no CUDA context exists; here the script is read (ast) and refused with the line to move.
"""

from __future__ import annotations

import ast
import inspect
import sys
from pathlib import Path


class UnguardedMainError(RuntimeError):
    """The engine is built from the main script's top level, which spawn would run again per worker."""


def check_spawn_safe() -> None:
    """UnguardedMainError naming the script and line when the current call comes from the main
    script's module-level code outside an `if __name__ == "__main__":` block."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not path or not Path(path).is_file():
        return  # an interactive session, `python -c`: spawn does not import a main module again
    frame = inspect.currentframe()
    while frame is not None and not (frame.f_globals is main.__dict__ and frame.f_code.co_name == "<module>"):
        frame = frame.f_back
    if frame is None:
        return  # not called from the script's top level (a thread, a test runner)
    line = frame.f_lineno
    if not is_guarded_line(Path(path).read_text(encoding="utf-8", errors="replace"), line):
        raise UnguardedMainError(
            f"tensor_parallel_size > 1 starts worker processes with spawn, which runs {path}'s top level again "
            f"in each of them; line {line} builds the engine there. Move that code under "
            "`if __name__ == \"__main__\":` (into a main() called from that block).")


def is_guarded_line(source: str, line: int) -> bool:
    """True when `line` of the module `source` lies inside a top-level `if __name__ == "__main__":`."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return True  # cannot tell: let spawn's own failure speak
    for node in tree.body:
        if isinstance(node, ast.If) and _is_main_test(node.test) and node.body[0].lineno <= line <= node.end_lineno:
            return True
    return False


def _is_main_test(test: ast.expr) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    is_name = any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides)
    is_main = any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides)
    return is_name and is_main
