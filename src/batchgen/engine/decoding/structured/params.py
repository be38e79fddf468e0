"""StructuredOutputsParams: what a request's output must match, with vLLM's names; checked on construction.

Exactly one constraint per request:
- `json`: a JSON schema (a dict, or a string holding one). The output is one JSON value the schema
  accepts, object properties in the schema's order. An object that names its properties takes no
  others unless the schema says `additionalProperties` (strict_schema.py says why).
- `regex`: the whole output matches the regular expression (Rust `regex` syntax: no look-around,
  no backreferences; no anchors needed).
- `choice`: the output is exactly one of the strings.
- `grammar`: a context-free grammar in Lark form (`start: ...`, llguidance's dialect) or llama.cpp's
  GBNF (`root ::= ...`); a grammar holding `::=` is read as GBNF.
- `json_object`: any JSON object (OpenAI's `response_format: {type: json_object}`).

`disable_any_whitespace` (vLLM's name): False (the default, as vLLM) lets JSON hold any whitespace
between its tokens, so a model can write the indented JSON it was trained on; True allows exactly
`", "` between items and `": "` after keys and no other whitespace (`{"a": 1, "b": [2, 3]}`):
shorter outputs, and no room for a small model to loop on newlines.

What can be checked without the grammar library is checked here (one constraint, types, an empty
choice list or choice, a schema string that is not JSON); what only the library can tell (a schema
keyword it does not implement, an unsatisfiable schema, a regex that does not parse or matches
nothing) when the grammar is compiled (compiler.py). Either way the error is a StructuredOutputError
naming the field.

`GuidedDecodingParams` is the older spelling of the same class (vLLM renamed it; both are accepted).
"""

from __future__ import annotations

import hashlib
import json as json_module
from dataclasses import dataclass, field
from typing import Any

CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputError(ValueError):
    """A constraint that cannot be used: `field` is the StructuredOutputsParams field it is about
    (None: the set of fields given, as when none or two constraints are set)."""

    def __init__(self, field_name: str | None, reason: str):
        super().__init__(f"structured_outputs{'.' + field_name if field_name else ''}: {reason}")
        self.field = field_name
        self.reason = reason


@dataclass
class StructuredOutputsParams:
    """One output constraint (see the module docstring). A `json` string is parsed on construction:
    the field then holds the schema as a dict."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None  # False is the same as unset
    disable_any_whitespace: bool = False
    _key: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.json_object is False:
            self.json_object = None
        given = [name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None]
        if len(given) != 1:
            raise StructuredOutputError(
                None,
                f"exactly one of {', '.join(CONSTRAINT_FIELDS)} must be set; got "
                f"{', '.join(given) if given else 'none'}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise StructuredOutputError("disable_any_whitespace", f"must be true or false; got "
                                                                  f"{self.disable_any_whitespace!r}")
        check = getattr(self, f"_check_{given[0]}")
        check()

    def _check_json(self) -> None:
        schema = self.json
        if isinstance(schema, str):
            try:
                schema = json_module.loads(schema)
            except json_module.JSONDecodeError as exc:
                raise StructuredOutputError("json", f"is not valid JSON: {exc}") from None
            except RecursionError:  # nested past the parser's recursion limit: no schema needs that
                raise StructuredOutputError("json", "nests too deep to be a schema") from None
        if not isinstance(schema, dict):
            raise StructuredOutputError("json", f"must be a JSON schema object; got {type(schema).__name__}")
        self.json = schema

    def _check_regex(self) -> None:
        if not isinstance(self.regex, str) or not self.regex:
            raise StructuredOutputError("regex", f"must be a non-empty string; got {self.regex!r}")

    def _check_choice(self) -> None:
        choice = self.choice
        if isinstance(choice, str) or not isinstance(choice, (list, tuple)):
            raise StructuredOutputError("choice", f"must be a list of strings; got {type(choice).__name__}")
        if not choice:
            raise StructuredOutputError("choice", "must hold at least one string; got an empty list")
        bad = [c for c in choice if not isinstance(c, str) or not c]
        if bad:
            raise StructuredOutputError("choice", f"must hold non-empty strings; got {bad[0]!r}")
        self.choice = list(choice)

    def _check_grammar(self) -> None:
        if not isinstance(self.grammar, str) or not self.grammar.strip():
            raise StructuredOutputError("grammar", f"must be a non-empty grammar string; got {self.grammar!r}")

    def _check_json_object(self) -> None:
        if self.json_object is not True:
            raise StructuredOutputError("json_object", f"must be true or false; got {self.json_object!r}")

    @property
    def kind(self) -> str:
        """Which constraint: json, regex, choice, grammar or json_object."""
        return next(name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None)

    @property
    def spec(self) -> str:
        """The constraint as one canonical string: a schema or choice list as compact JSON (keys in
        their given order: property order shapes the grammar), a regex or grammar as given."""
        kind = self.kind
        if kind in ("json", "choice"):
            return json_module.dumps(getattr(self, kind), separators=(",", ":"), ensure_ascii=False)
        if kind == "json_object":
            return ""
        return getattr(self, kind)

    @property
    def is_json(self) -> bool:
        return self.kind in ("json", "json_object")

    @property
    def key(self) -> str:
        """Hash of the canonical spec and the options that shape the grammar: the compile cache's key."""
        if not self._key:
            options = {"disable_any_whitespace": self.disable_any_whitespace} if self.is_json else {}
            text = json_module.dumps([self.kind, self.spec, options], separators=(",", ":"), ensure_ascii=False)
            self._key = hashlib.sha256(text.encode()).hexdigest()
        return self._key

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> StructuredOutputsParams:
        """From a mapping (a job file, a request body): an unknown key is an error naming it."""
        if not isinstance(values, dict):
            raise StructuredOutputError(None, f"must be a mapping; got {type(values).__name__}")
        allowed = (*CONSTRAINT_FIELDS, "disable_any_whitespace")
        unknown = [k for k in values if k not in allowed]
        if unknown:
            raise StructuredOutputError(unknown[0], f"is not a structured_outputs field (known: {', '.join(allowed)})")
        return cls(**values)


GuidedDecodingParams = StructuredOutputsParams  # vLLM's older name for the same parameters
