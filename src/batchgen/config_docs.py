"""Config fields' docstrings: the one source of `--help` and of the generated reference.

A field's description is a string literal right under it (an attribute docstring, as vLLM's config
classes write them):

    max_num_seqs: int = 128
    \"\"\"Sequences in one step at most.\"\"\"

`field_docs` reads them from a class's source with `ast` (base classes first, so a subclass may
redocument a field). pydantic models set `use_attribute_docstrings=True` and get the same text as
their fields' `description`. Imports only the standard library: every package may use it.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap


def field_docs(cls: type) -> dict[str, str]:
    """{field name: its docstring} for `cls` and its bases; a field without one is absent."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is not object:
            docs.update(_own_field_docs(klass))
    return docs


@functools.cache
def _own_field_docs(cls: type) -> dict[str, str]:
    """The docstrings under the fields `cls` itself declares (none when its source cannot be read:
    a class made at run time, e.g. by pydantic's create_model)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    classdef = next((node for node in ast.parse(source).body if isinstance(node, ast.ClassDef)), None)
    if classdef is None:
        return {}
    docs = {}
    for node, following in zip(classdef.body, classdef.body[1:]):
        name = _assigned_name(node)
        if name is not None and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant) \
                and isinstance(following.value.value, str):
            docs[name] = inspect.cleandoc(following.value.value)
    return docs


def _assigned_name(node: ast.stmt) -> str | None:
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return node.target.id
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id
    return None


def field_names(cls: type) -> list[str]:
    """The fields of a dataclass or a pydantic model, in declaration order."""
    if dataclasses.is_dataclass(cls):
        return [f.name for f in dataclasses.fields(cls)]
    return list(getattr(cls, "model_fields", {}))


def field_doc(cls: type, name: str) -> str | None:
    """A field's description: a pydantic field's `description` (its docstring, or what a derived
    section copied from its dataclass), else the attribute docstring."""
    info = getattr(cls, "model_fields", {}).get(name)
    if info is not None and info.description:
        return info.description
    return field_docs(cls).get(name)


def undocumented_fields(cls: type) -> list[str]:
    """The fields of `cls` that have no description: what the docs test reports."""
    return [name for name in field_names(cls) if not (field_doc(cls, name) or "").strip()]


def format_default(value: object) -> str:
    """A default as a job file or a flag writes it: null, true, false, [], {}, "" or the value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple, dict)) and not value:
        return "{}" if isinstance(value, dict) else "[]"
    return str(value) if value != "" else '""'
