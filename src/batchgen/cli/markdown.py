"""Markdown for the generated reference: table cells safe for Python-Markdown's tables (mkdocs-material),
type annotations and defaults as a job file writes them."""

from __future__ import annotations

import re
import types
import typing
from typing import Any

from batchgen.config_docs import format_default

_CODE_SPAN = re.compile(r"(`[^`]*`)")


def cell(text: str) -> str:
    """One table cell: one line; outside code spans `|` escaped (a pipe in a code span does not split
    the row, and a backslash there would show), `<`, `*` and a word's leading `_` escaped (no HTML, no
    emphasis)."""
    parts = _CODE_SPAN.split(" ".join(str(text).split()))
    return "".join(part if part.startswith("`") and part.endswith("`") and len(part) > 1 else _escaped(part)
                   for part in parts)


def _escaped(text: str) -> str:
    text = text.replace("\\", "\\\\").replace("|", "\\|").replace("<", "&lt;").replace("*", "\\*")
    return re.sub(r"(?<!\w)_", r"\\_", text)


def code(text: str) -> str:
    """`text` as a code span (a longer fence when it holds a backtick)."""
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    """A pipe table; the cells are given ready (see cell)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def type_name(annotation: Any) -> str:
    """An annotation as a reader writes it: `int | null`, `auto | cpu`, `list[str]`, `dict[str, any]`."""
    if annotation is type(None):
        return "null"
    if annotation is Any:
        return "any"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:  # a discriminated union: its members
        return type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is typing.Literal:
        return " | ".join(str(a) for a in args)
    if origin in (list, tuple):
        return f"list[{type_name(args[0])}]" if args else "list"
    if origin is dict:
        return f"dict[{', '.join(type_name(a) for a in args)}]" if args else "dict"
    return getattr(annotation, "__name__", str(annotation))


def default_cell(value: Any) -> str:
    """A default as a code span (empty for a missing one)."""
    return "" if value is ... else code(format_default(value))
