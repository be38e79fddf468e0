"""The request fields that constrain the output, as one StructuredOutputsParams and the field that set it.

OpenAI's `response_format` (`{"type": "json_object"}`, `{"type": "json_schema", "json_schema": {"name",
"schema", "strict", "description"}}`; `{"type": "text"}` is no constraint), and vLLM's extra fields:
`structured_outputs` (StructuredOutputsParams' fields: json, regex, choice, grammar, json_object,
disable_any_whitespace) and the older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.
At most one of them per request. Objects in a schema take no properties beyond the ones they name
whether or not `strict` is set (OpenAI's strict mode; engine/decoding/structured/strict_schema.py says why).
A bad value is a 400 naming the field; so is a constraint the grammar library refuses, found when the
request is compiled (`error_param` names the field then).
"""

from __future__ import annotations

from typing import Any

from batchgen.engine.decoding.structured import (
    StructuredOutputError,
    StructuredOutputsParams,
    StructuredOutputUnavailable,
)
from batchgen.openai.api_error import APIError, bad_request

STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar")
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_JSON_SCHEMA_KEYS = ("name", "schema", "strict", "description")
SCHEMA_PARAM = "response_format.json_schema.schema"


def _is_set(name: str, value: Any) -> bool:
    if value is None:
        return False
    return not (name == "response_format" and isinstance(value, dict) and value == {"type": "text"})


def structured_constraint(values: dict[str, Any]) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the constraint, the request field that set it) from the request's STRUCTURED_FIELDS values;
    (None, None) when none is set. An APIError (400) naming the field for a value that cannot be one."""
    given = [name for name in STRUCTURED_FIELDS if _is_set(name, values.get(name))]
    if not given:
        return None, None
    if len(given) > 1:
        raise bad_request(f"{given[1]}: set one output constraint per request; {given[0]} is set too", given[1])
    name = given[0]
    value = values[name]
    try:
        if name == "response_format":
            return _response_format(value)
        if name == "structured_outputs":
            if not isinstance(value, dict):
                raise bad_request(f"structured_outputs must be an object; got {type(value).__name__}",
                                  "structured_outputs")
            return StructuredOutputsParams.from_dict(value), name
        return StructuredOutputsParams(**{_GUIDED[name]: value}), name
    except StructuredOutputError as exc:
        param = error_param(name, exc)
        raise bad_request(f"{param}: {exc.reason}", param) from None


def _response_format(value: Any) -> tuple[StructuredOutputsParams, str]:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad_request("response_format must be an object with a type (text, json_object or json_schema)",
                          "response_format")
    kind = value["type"]
    extra = [k for k in value if k not in ("type", "json_schema")]
    if extra:
        raise bad_request(f"response_format.{extra[0]}: unknown field", f"response_format.{extra[0]}")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True), "response_format"
    if kind != "json_schema":
        raise bad_request(f"response_format.type must be text, json_object or json_schema; got {kind!r}",
                          "response_format.type")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format.json_schema is required with type json_schema (an object with name "
                          "and schema)", "response_format.json_schema")
    unknown = [k for k in spec if k not in _JSON_SCHEMA_KEYS]
    if unknown:
        raise bad_request(f"response_format.json_schema.{unknown[0]}: unknown field",
                          f"response_format.json_schema.{unknown[0]}")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise bad_request("response_format.json_schema.name is required (a non-empty string)",
                          "response_format.json_schema.name")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise bad_request("response_format.json_schema.strict must be true or false",
                          "response_format.json_schema.strict")
    if not isinstance(spec.get("schema"), dict):
        raise bad_request(f"{SCHEMA_PARAM} is required (a JSON schema object)", SCHEMA_PARAM)
    return StructuredOutputsParams(json=spec["schema"]), SCHEMA_PARAM


def error_param(field_name: str | None, exc: StructuredOutputError) -> str | None:
    """The request field a StructuredOutputError is about: inside `structured_outputs` its own field,
    else the field that set the constraint."""
    if field_name == "structured_outputs" and exc.field:
        return f"structured_outputs.{exc.field}"
    return field_name


def compile_error(field_name: str | None, exc: StructuredOutputError):
    """The 400 for a constraint the grammar library refuses."""
    param = error_param(field_name, exc)
    return bad_request(f"{param}: {exc.reason}", param)


def compile_request_constraint(engine, request, params) -> None:
    """Compile a request's constraint with the engine's compiler (cached: its add_request finds it
    there): a 400 naming the request field when the grammar library refuses it."""
    if params.structured_outputs is None:
        return
    try:
        engine.compile_grammar(params.structured_outputs)
    except StructuredOutputError as exc:
        raise compile_error(request.structured()[1], exc) from None
    except StructuredOutputUnavailable as exc:
        raise APIError(501, str(exc), request.structured()[1], "structured_output_unavailable") from None
