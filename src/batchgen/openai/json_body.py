"""A request body as JSON, refused (400 naming the place) where Python would choke on it later.

`json.loads` takes things a request model cannot use safely: nesting deep enough to exhaust the
recursion limit (a RecursionError in the parser or in anything that walks the value afterwards),
strings holding lone UTF-16 surrogates (`"\\ud800"` is valid JSON, but no UTF-8 encoder, tokenizer or
Arrow column takes it), and the non-standard constants NaN and Infinity. `load_json_body` parses and
checks in one pass over the value, without recursion.
"""

from __future__ import annotations

import json
from typing import Any

from batchgen.openai.api_error import bad_request

# Deeper than any OpenAI request body needs (messages[i].content[j].text is 5 levels), shallow enough
# that no recursive consumer (pydantic, json.dumps, our own walks) comes near Python's recursion limit.
MAX_JSON_DEPTH = 32


def load_json_body(data: bytes | str) -> Any:
    """The parsed body; an APIError (400) naming `body` or the field at fault otherwise."""
    try:
        value = json.loads(data, parse_constant=_refuse_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}", "body", "invalid_json") from None
    except RecursionError:
        raise bad_request(f"the request body nests JSON arrays or objects deeper than {MAX_JSON_DEPTH} "
                          "levels", "body", "invalid_json") from None
    except ValueError as exc:  # a NaN or Infinity constant
        raise bad_request(f"the request body is not valid JSON: {exc}", "body", "invalid_json") from None
    check_json_value(value)
    return value


def check_json_value(value: Any) -> None:
    """Refuse nesting deeper than MAX_JSON_DEPTH and strings (values or keys) that are not valid Unicode
    text (lone surrogates); the APIError's `param` is the path (`messages[0].content`, `stop[1]`)."""
    stack: list[tuple[Any, tuple, int]] = [(value, (), 0)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, str):
            _check_text(item, path)
            continue
        if not isinstance(item, (dict, list)):
            continue
        if depth >= MAX_JSON_DEPTH:
            raise bad_request(f"{_param(path)} nests JSON arrays or objects deeper than {MAX_JSON_DEPTH} "
                              "levels", _param(path), "invalid_json")
        if isinstance(item, dict):
            for key, child in item.items():
                _check_text(key, path, is_key=True)
                stack.append((child, (*path, key), depth + 1))
        else:
            stack.extend((child, (*path, i), depth + 1) for i, child in enumerate(item))


def _check_text(text: str, path: tuple, is_key: bool = False) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        where = f"a key in {_param(path)}" if is_key else _param(path)
        raise bad_request(f"{where} holds a lone UTF-16 surrogate ({text[exc.start]!r} at character "
                          f"{exc.start}), which is not text: send valid Unicode", _param(path),
                          "invalid_string") from None


def _param(path: tuple) -> str:
    """`messages[0].content` for ("messages", 0, "content"); `body` for the body itself."""
    if not path:
        return "body"
    text = ""
    for part in path:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            shown = part if part.isidentifier() else json.dumps(part)  # a key that is no name shows quoted
            text += f".{shown}" if text else shown
    return text


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")

