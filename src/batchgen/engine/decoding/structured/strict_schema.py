"""Close a JSON schema's objects: no properties beyond the ones named, unless the schema says otherwise.

JSON Schema lets an object hold any property it does not name unless `additionalProperties` says
no, and a grammar built from the schema allows the same: a model left free to add keys adds them
(plausible-looking extra fields in every other record). Synthesized records are meant to have the
fields their schema names, so an object schema that names properties (`properties` or
`patternProperties`) and says nothing of `additionalProperties` / `unevaluatedProperties` gets
`additionalProperties: false` (what OpenAI's strict mode requires and vLLM's xgrammar backend does).
An object schema that names no property (`{"type": "object"}`) stays open. The branches of an
`allOf` are left as written: closing each would refuse the properties the other branches add.
"""

from __future__ import annotations

import copy

# Keywords holding a map of name -> subschema, one subschema, or a list of subschemas.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = ("additionalProperties", "unevaluatedProperties", "propertyNames", "contains", "items",
               "additionalItems", "unevaluatedItems", "not", "if", "then", "else")
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "items")


def close_objects(schema: dict) -> dict:
    """A copy of `schema` with every object that names properties closed to others (see above)."""
    closed = copy.deepcopy(schema)
    _close(closed)
    return closed


def _close(node) -> None:
    if not isinstance(node, dict):
        return  # true / false schemas
    names_properties = isinstance(node.get("properties"), dict) or isinstance(node.get("patternProperties"), dict)
    if names_properties and "additionalProperties" not in node and "unevaluatedProperties" not in node:
        node["additionalProperties"] = False
    for keyword in _SCHEMA_MAPS:
        if isinstance(node.get(keyword), dict):
            for sub in node[keyword].values():
                _close(sub)
    for keyword in _SCHEMA_ONE:
        _close(node.get(keyword))
    for keyword in _SCHEMA_LISTS:
        if isinstance(node.get(keyword), list):
            for sub in node[keyword]:
                _close(sub)
