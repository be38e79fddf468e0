"""JSON-schema keywords the grammar library (xgrammar) accepts but does not enforce, found before compiling.

xgrammar compiles these schemas without an error and then lets outputs through that break them
(each checked on xgrammar 0.2.9 with a string the keyword forbids and the grammar accepted):
`multipleOf`, `uniqueItems`, `not`, `allOf` of two or more schemas, `if`/`then`/`else`,
`dependentRequired`/`dependentSchemas`/`dependencies`, `minContains`/`maxContains`, a `format` it
does not know, and `minLength`/`maxLength` beside a `pattern` or `format` (the pattern wins, the
length is dropped). A constraint that is silently half-enforced is worse than a clear refusal, so
such a schema is refused up front with the keyword and where it sits (vLLM refuses the same set).
"""

from __future__ import annotations

# String formats xgrammar turns into grammar rules.
SUPPORTED_FORMATS = frozenset({
    "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
    "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
})
_ALWAYS_UNENFORCED = ("multipleOf", "not", "if", "then", "else", "dependentRequired", "dependentSchemas",
                      "dependencies", "minContains", "maxContains")
# Keywords whose value is a map of name -> subschema, one subschema, or a list of subschemas.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_ONE = ("additionalProperties", "unevaluatedProperties", "propertyNames", "contains", "items",
               "additionalItems", "unevaluatedItems")
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf", "items")


def unenforced_keywords(schema: dict) -> list[str]:
    """'keyword at #/path' for each keyword of `schema` (a dict) the library would not enforce."""
    found: list[str] = []
    _walk(schema, "#", found)
    return found


def _walk(node, path: str, found: list[str]) -> None:
    if not isinstance(node, dict):
        return  # true / false schemas, or a value no schema reader would treat as a schema
    for keyword in _ALWAYS_UNENFORCED:
        if keyword in node:
            found.append(f"'{keyword}' at {path}")
    if node.get("uniqueItems") is True:
        found.append(f"'uniqueItems' at {path}")
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        found.append(f"'allOf' of {len(node['allOf'])} schemas at {path}")
    fmt = node.get("format")
    if isinstance(fmt, str) and fmt not in SUPPORTED_FORMATS:
        found.append(f"'format: {fmt}' at {path} (known formats: {', '.join(sorted(SUPPORTED_FORMATS))})")
    if ("pattern" in node or "format" in node) and ("minLength" in node or "maxLength" in node):
        found.append(f"'minLength'/'maxLength' beside 'pattern'/'format' at {path} (put the length in the pattern)")
    for keyword in _SCHEMA_MAPS:
        value = node.get(keyword)
        if isinstance(value, dict):
            for name, sub in value.items():
                _walk(sub, f"{path}/{keyword}/{name}", found)
    for keyword in _SCHEMA_ONE:
        if isinstance(node.get(keyword), dict):
            _walk(node[keyword], f"{path}/{keyword}", found)
    for keyword in _SCHEMA_LISTS:
        value = node.get(keyword)
        if isinstance(value, list):
            for i, sub in enumerate(value):
                _walk(sub, f"{path}/{keyword}/{i}", found)
