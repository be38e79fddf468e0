"""OpenAI's request bodies for /v1/chat/completions and /v1/completions as pydantic models, checked
field by field, and their mapping onto SamplingParams.

A field batchgen does not implement is refused by name (400), never ignored: a null (or the
field's do-nothing value, such as `response_format: {"type": "text"}`) counts as not sent.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from batchgen.engine import SamplingParams
from batchgen.engine.config import SettingError
from batchgen.pipeline.openai.api_error import bad_request

# Fields of OpenAI's (or vLLM's) API that batchgen does not implement, with what to say.
UNSUPPORTED = {
    "response_format": "structured output is not implemented (only {\"type\": \"text\"})",
    "tools": "tool calling is not implemented",
    "tool_choice": "tool calling is not implemented",
    "functions": "function calling is not implemented",
    "function_call": "function calling is not implemented",
    "parallel_tool_calls": "tool calling is not implemented",
    "logit_bias": "logit_bias is not implemented",
    "audio": "audio output is not implemented",
    "modalities": "only text output is implemented",
    "prediction": "predicted outputs are not implemented",
    "reasoning_effort": "reasoning settings are not implemented",
    "web_search_options": "web search is not implemented",
    "store": "stored completions are not implemented",
    "metadata": "stored completions are not implemented",
    "service_tier": "service tiers are not implemented",
    "suffix": "suffix (insertion) is not implemented",
    "best_of": "best_of is not implemented (use n)",
    "include_stop_str_in_output": "the stop string is never part of the text",
    "guided_json": "structured output is not implemented",
    "guided_regex": "structured output is not implemented",
    "guided_choice": "structured output is not implemented",
    "guided_grammar": "structured output is not implemented",
    "structured_outputs": "structured output is not implemented",
}


# Request sampling fields whose default (the field left unset) is not SamplingParams', with the reason.
# docs/architecture.md's defaults table lists them beside the job file's (pipeline/job_settings.py).
SERVER_DEFAULTS = {
    "max_tokens": (
        "chat: what max_model_len leaves after the prompt; completions: 16",
        "OpenAI's chat API caps a completion only when asked (max_tokens / max_completion_tokens); its "
        "completions API, like vLLM's, defaults to 16"),
}


def _is_unused(name: str, value: Any, body: dict) -> bool:
    """A value that asks for nothing: null, false, empty, or the field's default behaviour."""
    if value is None or value is False or value == {} or value == []:
        return True
    if name == "response_format":
        return value == {"type": "text"}
    if name == "tool_choice":
        return value == "none"
    if name == "best_of":
        return value == body.get("n", 1)
    return False


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict] | None = None
    name: str | None = None

    def to_template(self, index: int) -> dict:
        """{role, content[, name]} for the chat template; text parts are joined, other parts refused."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                    raise bad_request(f"messages[{index}].content[{j}]: only text parts "
                                      "({\"type\": \"text\", \"text\": ...}) are supported",
                                      f"messages[{index}].content")
                texts.append(part["text"])
            content = "".join(texts)
        message = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class _SamplingRequest(BaseModel):
    """What both endpoints accept: OpenAI's sampling fields and vLLM's extra ones."""

    model_config = ConfigDict(extra="allow")  # extras are checked against UNSUPPORTED, then refused

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for abuse tracking upstream: changes nothing here
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None  # the prompt tokens' log-probabilities (and top N), as vLLM's
    use_beam_search: bool = False  # vLLM's: n beams (beam_width = n), ranked by length_penalty
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def num_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    def prompt_logprobs_field(self) -> str:
        return "prompt_logprobs"

    def check_combinations(self) -> None:
        """What cannot go together, named by field (400): streams carry no prompt log-probabilities
        and no beams (vLLM neither streams beam search)."""
        if self.stream and self.use_beam_search:
            raise bad_request("stream is not available with use_beam_search (the beams are ranked at the end)",
                              "stream")
        if self.stream and self.num_prompt_logprobs() is not None:
            raise bad_request("stream is not available with prompt_logprobs (or echo with logprobs)", "stream")

    def sampling_params(self, max_tokens: int, logprobs: int | None, logprobs_field: str,
                        max_tokens_field: str) -> SamplingParams:
        """SamplingParams with OpenAI's defaults for unset fields; a bad value is a 400 naming its field."""
        default_temperature = 0.0 if self.use_beam_search else 1.0  # beam search samples nothing
        values = dict(
            n=self.n, temperature=default_temperature if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=-1 if self.top_k is None else self.top_k,
            min_p=self.min_p or 0.0, presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            max_tokens=max_tokens, min_tokens=self.min_tokens, seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
            prompt_logprobs=self.num_prompt_logprobs(), beam_width=self.n if self.use_beam_search else 1,
            length_penalty=self.length_penalty, early_stopping=self.early_stopping)
        try:
            return SamplingParams(**values)
        except SettingError as exc:
            field = {"max_tokens": max_tokens_field, "logprobs": logprobs_field, "beam_width": "n",
                     "prompt_logprobs": self.prompt_logprobs_field()}.get(exc.name, exc.name)
            if exc.name in ("length_penalty", "early_stopping") and not self.use_beam_search:
                raise bad_request(f"{exc.name} applies to beam search only (use_beam_search: true)", exc.name) from None
            raise bad_request(f"{field} {exc.rule}; got {exc.value!r}", field) from None


class ChatCompletionRequest(_SamplingRequest):
    LOGPROBS_FIELD: ClassVar[str] = "top_logprobs"  # the field that sets SamplingParams.logprobs' N
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """(the completion budget asked for or None, the field that asked)."""
        if self.max_completion_tokens is not None:  # the newer name wins, as in OpenAI's API
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict]:
        return [m.to_template(i) for i, m in enumerate(self.messages)]


class CompletionRequest(_SamplingRequest):
    LOGPROBS_FIELD: ClassVar[str] = "logprobs"
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's (and vLLM's) default for completions
    logprobs: int | None = None
    echo: bool = False  # the prompt before the completion, in the text and (with logprobs) the logprobs

    def prompt_logprobs_field(self) -> str:
        return "prompt_logprobs" if self.prompt_logprobs is not None else "logprobs"

    @property
    def is_echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt alone (one token is generated and left out, as vLLM does)."""
        return self.echo and self.max_tokens == 0

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """(the completion budget asked for or None, the field that asked)."""
        if self.max_tokens == 0:
            if not self.echo:
                raise bad_request("max_tokens must be >= 1 (0 only with echo: true, the prompt alone)",
                                  "max_tokens")
            return 1, "max_tokens"
        return self.max_tokens, "max_tokens"

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def check_combinations(self) -> None:
        super().check_combinations()
        if self.stream and self.echo:
            raise bad_request("stream is not available with echo (the prompt comes in the whole response)",
                              "stream")

    def num_prompt_logprobs(self) -> int | None:
        """vLLM's: prompt_logprobs when given, else with echo the request's logprobs."""
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string, or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise bad_request("prompt is empty", "prompt")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return list(prompt)


def parse_json_object(body: bytes | str | dict) -> dict:
    """The body as a JSON object, or an APIError (400) naming `body`."""
    if isinstance(body, dict):
        return body
    try:
        raw = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}", "body", "invalid_json") from None
    if not isinstance(raw, dict):
        raise bad_request("the request body must be a JSON object", "body", "invalid_json")
    return raw


def parse_request(body: bytes | str | dict, model: type[_SamplingRequest]) -> _SamplingRequest:
    """The body (JSON text or an already parsed object) as `model`, or an APIError (400) naming the
    first field at fault (`body` itself when it is not a JSON object)."""
    raw = parse_json_object(body)
    try:
        request = model.model_validate(raw)
    except ValidationError as exc:
        raise _field_error(exc) from None
    for name, value in (request.model_extra or {}).items():
        if name in UNSUPPORTED and not _is_unused(name, value, raw):
            raise bad_request(f"{name} is not supported: {UNSUPPORTED[name]}", name, "unsupported_parameter")
        if name not in UNSUPPORTED:
            raise bad_request(f"unknown field {name!r}", name, "unknown_parameter")
    return request


# The request model of each endpoint (the `url` of an OpenAI Batch line).
REQUEST_MODELS: dict[str, type[_SamplingRequest]] = {}


def sampling_params_from_body(request: _SamplingRequest, default_max_tokens: int | None = None) -> SamplingParams:
    """SamplingParams for a parsed request (parse_request), with OpenAI's defaults for unset fields.

    `default_max_tokens` applies when the body sets no completion budget (chat's max_tokens and
    max_completion_tokens are optional; the server passes what is left of the context). A bad value,
    or none at all, is an APIError (400) naming the request's own field (`top_logprobs`,
    `max_completion_tokens`, ...).
    """
    request.check_combinations()
    max_tokens, max_tokens_field = request.requested_max_tokens()
    if max_tokens is None:
        max_tokens = default_max_tokens
    if max_tokens is None:
        raise bad_request(f"{max_tokens_field} is required", max_tokens_field, "missing_required_parameter")
    return request.sampling_params(max_tokens, request.num_logprobs(), request.LOGPROBS_FIELD, max_tokens_field)


def _field_error(exc: ValidationError):
    err = exc.errors()[0]
    loc = [p for p in err["loc"]]
    param = str(loc[0]) if loc else "body"
    if param == "messages" and len(loc) >= 2 and isinstance(loc[1], int):
        param = f"messages[{loc[1]}]" + (f".{loc[2]}" if len(loc) >= 3 and isinstance(loc[2], str) else "")
    if err["type"] == "extra_forbidden":
        return bad_request(f"{param}: unknown field", param, "unknown_parameter")
    if err["type"] == "missing":
        return bad_request(f"{param} is required", param, "missing_required_parameter")
    given = err.get("input")
    shown = "" if isinstance(given, (dict, list)) else f" (got {given!r})"
    return bad_request(f"{param}: {err['msg']}{shown}", param)


REQUEST_MODELS.update({"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest})
