"""OpenAI's Batch file format, as pure parsing and formatting (no job, no file system): an input line
`{"custom_id", "method", "url", "body"}` and its request, an output line `{"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error"}`.

A line's body is read with the server's request models (protocol.py), so it accepts exactly what
`POST /v1/chat/completions` or `/v1/completions` accepts and refuses the same fields by name; on top of
that a batch has no stream to send to and no place for the server-only answers (echo, prompt
log-probabilities, beams), and a completions line holds one prompt. Every refusal is an APIError
naming the field (`param`): a body field by its name, or `method`, `url`, `body` for the line's own keys.
"""

from __future__ import annotations

import json

from batchgen.openai.api_error import bad_request
from batchgen.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_request

CUSTOM_ID = "custom_id"
LINE_KEYS = (CUSTOM_ID, "method", "url", "body")
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
# Server fields a batch line may not set, with the value that asks for nothing (a line may send it).
_SERVER_ONLY = {"echo": False, "prompt_logprobs": None, "use_beam_search": False, "length_penalty": 1.0,
                "early_stopping": False}


def custom_id_of(line: bytes) -> tuple[str | None, str | None]:
    """(custom_id, None), or (None, what is wrong with the line)."""
    try:
        request = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return None, f"is not valid JSON ({exc})"
    except RecursionError:  # a body nested thousands deep: no custom_id can be read from it
        return None, "nests JSON too deep for the parser (thousands of levels)"
    if not isinstance(request, dict):
        return None, f"is not a JSON object (a {type(request).__name__})"
    custom_id = request.get(CUSTOM_ID)
    if custom_id is None:
        return None, "has no custom_id"
    if not isinstance(custom_id, str) or not custom_id:
        return None, f"has a custom_id that is not a non-empty string ({custom_id!r})"
    try:
        custom_id.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate escape: no output file or column can hold this id
        return None, f"has a custom_id that is not valid Unicode text ({custom_id!r})"
    return custom_id, None


def endpoint_of(line: dict) -> str | None:
    """"chat" or "completions" by the line's url; None for any other url."""
    return ENDPOINTS.get(line.get("url")) if isinstance(line.get("url"), str) else None


def line_request(line: dict) -> ChatCompletionRequest | CompletionRequest:
    """The request a line (a JSON object) holds; APIError naming the field a batch cannot take."""
    unknown = [key for key in line if key not in LINE_KEYS]
    if unknown:
        raise bad_request(f"unknown key(s) {', '.join(map(repr, unknown))} in the line; a line holds "
                          f"{', '.join(LINE_KEYS)}", unknown[0])
    if line.get("method") != "POST":
        raise bad_request(f"method must be \"POST\"; got {line.get('method')!r}", "method")
    endpoint = endpoint_of(line)
    if endpoint is None:
        raise bad_request(f"url {line.get('url')!r} is not supported; batchgen runs {' and '.join(ENDPOINTS)}",
                          "url")
    body = line.get("body")
    if not isinstance(body, dict):
        raise bad_request(f"body must be a JSON object (the request); got {type(body).__name__}", "body")
    request = parse_request(json.dumps(body).encode(), ChatCompletionRequest if endpoint == "chat" else CompletionRequest)
    for name in ("stream", "stream_options"):
        if body.get(name) not in (None, False):
            raise bad_request(f"{name} is not supported in a batch file (there is no stream to send)", name)
    for name, unset in _SERVER_ONLY.items():
        value = body.get(name)
        # `is`: 0 == False, and prompt_logprobs 0 asks for something
        if not (value is None or value is unset or (isinstance(unset, float) and value == unset
                                                    and not isinstance(value, bool))):
            raise bad_request(f"{name} is not supported in a batch file (a job scores continuations with task: "
                              "loglikelihood and runs beams with sampling.beam_width)", name)
    if request.skip_special_tokens is False:
        raise bad_request("skip_special_tokens: false is not supported in a batch job (the completion "
                          "is always the text without special tokens)", "skip_special_tokens")
    return request


def one_prompt(request: CompletionRequest) -> str | list[int]:
    """A completions line's prompt (a string or token ids); APIError for a list of prompts."""
    prompts = request.prompts()
    if len(prompts) != 1:
        raise bad_request(f"prompt: a batch line holds one prompt (a string or a list of token ids); got a "
                          f"list of {len(prompts)} prompts (write one line per prompt)", "prompt")
    return prompts[0]


def output_line(line_id: str, custom_id: str | None, request_id: str, status: int, body: dict) -> str:
    """One line of output.jsonl or errors.jsonl: the response (status and body) to one input line."""
    return json.dumps({"id": line_id, "custom_id": custom_id,
                       "response": {"status_code": status, "request_id": request_id, "body": body},
                       "error": None}, ensure_ascii=False)
