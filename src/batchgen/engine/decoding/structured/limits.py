"""Bounds a constraint must keep before the grammar library sees it.

The library (llguidance, native code) follows a JSON schema's `$ref`s by recursion: a chain of 1,000
nested references (~90 KB of schema) overflowed its native stack and took the whole process down (the
server with every connection; `batchgen run` on every rerun). Such inputs are refused here, in Python,
with an error naming the field; what passes these bounds is then compiled on a thread with a large stack
and a deadline (compiler.py), so a depth these bounds let through cannot crash either.

The bounds are far above what real constraints use (the deepest published schemas nest tens of levels;
choice lists are labels) and each is stated in docs/guides/structured-output.md.
"""

from __future__ import annotations

import re

from batchgen.engine.decoding.structured.params import StructuredOutputError, StructuredOutputsParams

MAX_SCHEMA_DEPTH = 256  # nested sub-schemas on one path, `$ref`s followed (a cycle is not followed twice)
MAX_SCHEMA_NODES = 20_000  # sub-schemas in the whole document (properties, items, alternatives, definitions)
MAX_CHOICES = 10_000  # strings in a `choice` list
MAX_CONSTRAINT_BYTES = 1 << 20  # a regex, grammar or choice list's total text
MAX_REGEX_REPEAT = 10_000  # the product of nested `{m,n}` bounds a regex may ask for
# The library's bound on one parse row (Earley items), checked as a request generates: a grammar past it
# fails that request only, with the library's message (scheduler: finish_reason "error").
MAX_ITEMS_IN_ROW = 20_000

# Keywords whose value is one sub-schema, a list of them, or a name -> sub-schema map.
_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
        "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def check_constraint_limits(params: StructuredOutputsParams) -> None:
    """StructuredOutputError naming the field when `params` exceeds a bound above."""
    if params.json is not None and isinstance(params.json, dict):
        check_schema_limits(params.json)
    elif params.choice is not None:
        if len(params.choice) > MAX_CHOICES:
            raise StructuredOutputError("choice", f"has {len(params.choice):,} strings; at most {MAX_CHOICES:,} "
                                                  "are allowed (a longer list is a grammar or a schema enum)")
        _check_bytes("choice", sum(len(c.encode("utf-8", "surrogatepass")) for c in params.choice))
    elif params.regex is not None:
        _check_bytes("regex", len(params.regex.encode("utf-8", "surrogatepass")))
        check_regex_repeats(params.regex)
    elif params.grammar is not None:
        _check_bytes("grammar", len(params.grammar.encode("utf-8", "surrogatepass")))


def _check_bytes(field_name: str, num_bytes: int) -> None:
    if num_bytes > MAX_CONSTRAINT_BYTES:
        raise StructuredOutputError(field_name, f"is {num_bytes:,} bytes; at most {MAX_CONSTRAINT_BYTES:,} are allowed")


def _children(node: dict) -> list:
    """The sub-schemas directly under one schema object."""
    found = []
    for key in _ONE:
        if isinstance(node.get(key), dict):
            found.append(node[key])
    for key in _LIST:
        value = node.get(key)
        if isinstance(value, list):
            found += [v for v in value if isinstance(v, dict)]
    if isinstance(node.get("items"), list):  # draft-04 tuple items
        found += [v for v in node["items"] if isinstance(v, dict)]
    for key in _MAP:
        value = node.get(key)
        if isinstance(value, dict):
            found += [v for v in value.values() if isinstance(v, dict)]
    return found


def _resolve(root: dict, ref: str):
    """The sub-schema a local `$ref` (#/a/b) points at, or None (remote refs are the library's to refuse)."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node if isinstance(node, dict) else None


def check_schema_limits(schema: dict) -> None:
    """The schema's size and its deepest path of nested sub-schemas, `$ref`s followed as the library
    follows them: iterative (a hostile schema cannot exhaust Python's stack either), each reference
    target's depth computed once (a DAG of references is linear work), a reference back to a schema on
    the current path (a recursive type) not followed again."""
    num_nodes = 0
    depth_of: dict[int, int] = {}  # id(schema node) -> the deepest path below it, itself included
    on_path: set[int] = set()
    # Each frame: (node, its children still to visit, the deepest child depth so far).
    stack: list[list] = []

    def enter(node: dict) -> None:
        nonlocal num_nodes
        num_nodes += 1
        if num_nodes > MAX_SCHEMA_NODES:
            raise StructuredOutputError("json", f"has more than {MAX_SCHEMA_NODES:,} sub-schemas")
        children = _children(node)
        if isinstance(node.get("$ref"), str):
            target = _resolve(schema, node["$ref"])
            if target is not None:
                children.append(target)
        on_path.add(id(node))
        stack.append([node, children, 0])
        if len(stack) > MAX_SCHEMA_DEPTH:
            raise StructuredOutputError("json", f"nests sub-schemas (through $ref or directly) more than "
                                                f"{MAX_SCHEMA_DEPTH} deep")

    enter(schema)
    while stack:
        frame = stack[-1]
        node, children = frame[0], frame[1]
        if children:
            child = children.pop()
            if id(child) in depth_of:
                frame[2] = max(frame[2], depth_of[id(child)])
                if len(stack) + depth_of[id(child)] > MAX_SCHEMA_DEPTH:
                    raise StructuredOutputError("json", f"nests sub-schemas (through $ref or directly) more "
                                                        f"than {MAX_SCHEMA_DEPTH} deep")
            elif id(child) not in on_path:
                enter(child)
            continue
        stack.pop()
        on_path.discard(id(node))
        depth_of[id(node)] = frame[2] + 1
        if stack:
            stack[-1][2] = max(stack[-1][2], depth_of[id(node)])


_REPEAT = re.compile(r"\{(\d+)(?:,(\d*))?\}")


def check_regex_repeats(regex: str) -> None:
    """The product of nested `{m,n}` bounds (`a{1000}{1000}` asks for a million `a`s; the library's lexer
    gave up part-way and the request then failed every other request in its step). A bound multiplies
    the atom before it; a group's factor is the largest inside it, so `(a{100}){100}` is 10,000."""
    inner = [1]  # per open group: the largest atom factor inside it so far
    last = 1  # the factor of the atom just before this position (a bound multiplies it)
    i = 0
    while i < len(regex):
        ch = regex[i]
        bound = _REPEAT.match(regex, i)
        if bound:
            low, high = bound.group(1), bound.group(2)
            last *= max(int(high) if high else int(low), 1)
            if last > MAX_REGEX_REPEAT:
                raise StructuredOutputError("regex", f"repeats {last:,} times through nested {{m,n}} bounds; "
                                                     f"at most {MAX_REGEX_REPEAT:,} are allowed")
            inner[-1] = max(inner[-1], last)
            i = bound.end()
        elif ch == "(":
            inner.append(1)
            last, i = 1, i + 1
        elif ch == ")":
            last = inner.pop() if len(inner) > 1 else 1
            inner[-1] = max(inner[-1], last)
            i += 1
        elif ch in "*+?|":  # unbounded or optional: no factor of its own
            i += 1
        else:  # one atom: an escape, a class, or a character
            if ch == "\\":
                i += 2
            elif ch == "[":
                i = _class_end(regex, i)
            else:
                i += 1
            last = 1


def _class_end(regex: str, start: int) -> int:
    """The index after the character class opening at `start` (a `]` first in the class is literal)."""
    j = start + 1
    if j < len(regex) and regex[j] == "^":
        j += 1
    if j < len(regex) and regex[j] == "]":
        j += 1
    while j < len(regex) and regex[j] != "]":
        j += 2 if regex[j] == "\\" else 1
    return j + 1
