"""OpenAI's request bodies for /v1/chat/completions and /v1/completions as pydantic models, checked
field by field, and their mapping onto SamplingParams.

A field batchgen does not implement is refused by name (400), never ignored: a null (or the
field's do-nothing value, such as `response_format: {"type": "text"}`) counts as not sent.

Types are strict, as OpenAI's API checks them: a string or a boolean is never a number (`"max_tokens":
"4"` and `"max_tokens": true` are 400s naming the field, where pydantic's lax mode would read 4 and 1),
a number never a boolean or a string. An integer field takes a number with no fractional part (4.0,
an integer in JSON Schema's sense); a number field takes an integer (`"temperature": 1`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, Strict, ValidationError

from batchgen.engine import SamplingParams
from batchgen.engine.config import SettingError
from batchgen.engine.decoding.structured import StructuredOutputsParams
from batchgen.engine.text.chat_template import ChatTemplateOptions
from batchgen.engine.text.tool_parsers import ToolParser, get_tool_parser
from batchgen.engine.text.tools import (
    ToolRequest,
    ToolsError,
    check_tool_choice,
    check_tools,
    forced_constraint,
    template_messages,
)
from batchgen.openai.api_error import bad_request
from batchgen.openai.json_body import check_json_value, load_json_body
from batchgen.openai.structured_fields import STRUCTURED_FIELDS, structured_constraint

# Fields of OpenAI's (or vLLM's) API that batchgen does not implement, with what to say.
UNSUPPORTED = {
    "tools": "tools are for /v1/chat/completions",
    "tool_choice": "tools are for /v1/chat/completions",
    "functions": "the deprecated functions field is not implemented (send tools)",
    "function_call": "the deprecated function_call field is not implemented (send tool_choice)",
    "parallel_tool_calls": "tools are for /v1/chat/completions",
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
    "chat_template": "a request cannot bring its own chat template; the server's is set with --chat-template",
    "guided_decoding_backend": "the grammar library is fixed (llguidance)",
    "guided_whitespace_pattern": "a whitespace pattern is not implemented (structured_outputs."
                                 "disable_any_whitespace allows none)",
}


# Request sampling fields whose default (the field left unset) is not SamplingParams', with the reason.
# docs/architecture.md's defaults table lists them beside the job file's (pipeline/job_settings.py).
SERVER_DEFAULTS = {
    "temperature": (
        "1.0, or generation_config.json's",
        ("OpenAI's and vLLM's 1.0; with --generation-config auto (the server's default, as vLLM's) the model's "
         "generation_config.json value when it sets one, as for top_p, top_k, min_p and repetition_penalty")),
    "max_tokens": (
        ("chat: what max_model_len leaves after the prompt (at most generation_config.json's max_new_tokens); "
         "completions: 16"),
        ("OpenAI's chat API caps a completion only when asked (max_tokens / max_completion_tokens); its "
         "completions API, like vLLM's, defaults to 16")),
}


def _is_unused(name: str, value: Any, body: dict) -> bool:
    """A value that asks for nothing: null, false, empty, or the field's default behaviour."""
    if value is None or value is False or value == {} or value == []:
        return True
    if name == "tool_choice":
        return value == "none"
    if name == "best_of":
        return value == body.get("n", 1)
    return False


def _integral(value: Any) -> Any:
    """4.0 -> 4 (an integer in JSON Schema's sense); anything else is left for the strict check."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, Strict(), BeforeValidator(_integral)]  # no bool, no string, no 4.5
Float = Annotated[float, Strict()]  # an int is fine; a bool or a string is not
Bool = Annotated[bool, Strict()]  # true/false only: not 1, not "true"
Str = Annotated[str, Strict()]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: Bool = False


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Str | list[dict] | None = None
    name: Str | None = None
    tool_calls: list[dict] | None = None  # an assistant's calls, as a response gave them
    tool_call_id: Str | None = None  # a tool message: the call it answers
    reasoning_content: Str | None = None  # an assistant's thinking, as a response gave it (templates may drop it)

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
        for key in ("tool_calls", "tool_call_id", "reasoning_content"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        if self.role == "tool" and self.tool_call_id is None:
            raise bad_request(f"messages[{index}].tool_call_id is required in a tool message",
                              f"messages[{index}].tool_call_id")
        return message


class _SamplingRequest(BaseModel):
    """What both endpoints accept: OpenAI's sampling fields and vLLM's extra ones."""

    model_config = ConfigDict(extra="allow")  # extras are checked against UNSUPPORTED, then refused

    model: Str | None = None
    n: Int = 1
    temperature: Float | None = None
    top_p: Float | None = None
    stop: Str | list[Str] | None = None
    seed: Int | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    stream: Bool = False
    stream_options: StreamOptions | None = None
    user: Str | None = None  # an end-user id for abuse tracking upstream: changes nothing here
    # vLLM's extra sampling fields
    top_k: Int | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    min_tokens: Int = 0
    ignore_eos: Bool = False
    stop_token_ids: list[Int] | None = None
    skip_special_tokens: Bool = True
    include_stop_str_in_output: Bool = False
    prompt_logprobs: Int | None = None  # the prompt tokens' log-probabilities (and top N), as vLLM's
    use_beam_search: Bool = False  # vLLM's: n beams (beam_width = n), ranked by length_penalty
    length_penalty: Float = 1.0
    early_stopping: Bool | Literal["never"] = False
    # structured output (structured_fields.py): OpenAI's response_format, vLLM's structured_outputs and
    # guided_* fields; checked there, naming the field
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    thinking_token_budget: Int | None = None  # vLLM's: reasoning tokens at most (--reasoning-parser)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def structured(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """(the output constraint, the field that set it), or (None, None); a 400 naming the field."""
        return structured_constraint({name: getattr(self, name) for name in STRUCTURED_FIELDS})

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
                        max_tokens_field: str, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """SamplingParams with OpenAI's defaults for unset fields, or the model's generation_config.json
        ones in `defaults` (engine/text/generation_config.py); a bad value is a 400 naming its field. Beam
        search samples nothing: its unset fields stay at the greedy defaults."""
        defaults = {} if self.use_beam_search else (defaults or {})

        def given_or_default(name: str, openai_default: float) -> float:
            value = getattr(self, name)
            return defaults.get(name, openai_default) if value is None else value

        values = dict(
            n=self.n, temperature=given_or_default("temperature", 0.0 if self.use_beam_search else 1.0),
            top_p=given_or_default("top_p", 1.0),
            top_k=given_or_default("top_k", -1), min_p=given_or_default("min_p", 0.0),
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=given_or_default("repetition_penalty", 1.0),
            max_tokens=max_tokens, min_tokens=self.min_tokens, seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=self.structured()[0],
            prompt_logprobs=self.num_prompt_logprobs(), beam_width=self.n if self.use_beam_search else 1,
            length_penalty=self.length_penalty, early_stopping=self.early_stopping,
            thinking_token_budget=self.thinking_token_budget)
        try:
            return SamplingParams(**values)
        except SettingError as exc:
            field = {"max_tokens": max_tokens_field, "logprobs": logprobs_field, "beam_width": "n",
                     "prompt_logprobs": self.prompt_logprobs_field(),
                     "structured_outputs": self.structured()[1]}.get(exc.name, exc.name)
            if exc.name in ("length_penalty", "early_stopping") and not self.use_beam_search:
                raise bad_request(f"{exc.name} applies to beam search only (use_beam_search: true)", exc.name) from None
            raise bad_request(f"{field} {exc.rule}; got {exc.value!r}", field) from None


class ChatCompletionRequest(_SamplingRequest):
    LOGPROBS_FIELD: ClassVar[str] = "top_logprobs"  # the field that sets SamplingParams.logprobs' N
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: Bool = False
    top_logprobs: Int | None = None
    # vLLM's chat-template fields
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    chat_template_kwargs: dict[Str, Any] | None = None
    # tools (engine/text/tools.py): checked and bound to the server's parser by bind_tools
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: Bool | None = None
    _tool_request: ToolRequest | None = PrivateAttr(default=None)
    _tool_parser: ToolParser | None = PrivateAttr(default=None)

    def bind_tools(self, parser_name: str | None, is_auto_enabled: bool = True) -> ToolRequest | None:
        """Check tools and tool_choice (a 400 naming the field) and bind them to the tool-call parser
        (`parser_name`; forced calls without one are written and read in hermes' format). `auto` needs
        a parser and, on the server, --enable-auto-tool-choice (as vLLM)."""
        try:
            tools = check_tools(self.tools) if self.tools is not None else None
            request = check_tool_choice(self.tool_choice, tools, self.parallel_tool_calls)
        except ToolsError as exc:
            raise bad_request(str(exc), exc.field) from None
        if request is not None and request.choice == "auto" and (parser_name is None or not is_auto_enabled):
            if self.tool_choice is None:  # tools without a choice and no parser: rendered, not parsed
                request = ToolRequest(request.tools, "none")
            else:
                raise bad_request('"auto" tool choice needs --enable-auto-tool-choice and --tool-call-parser '
                                  "to be set (a job: model.tool_call_parser)", "tool_choice")
        self._tool_request = request
        self._tool_parser = get_tool_parser(parser_name or "hermes") if request is not None else None
        return request

    @property
    def tool_request(self) -> ToolRequest | None:
        return self._tool_request

    @property
    def tool_parser(self) -> ToolParser | None:
        """The parser that reads this request's output for calls (None: not read)."""
        request = self._tool_request
        return self._tool_parser if request is not None and request.is_parsed else None

    def structured(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """Forced tool calls are the output constraint (field `tool_choice`); with another one, a 400."""
        request = self._tool_request
        if request is None or not request.is_forced:
            return super().structured()
        other = super().structured()
        if other[0] is not None:
            raise bad_request(f"{other[1]}: cannot constrain the output while tool_choice forces tool calls",
                              other[1])
        return forced_constraint(self._tool_parser, request), "tool_choice"

    def sampling_params(self, *args, **kwargs) -> SamplingParams:
        params = super().sampling_params(*args, **kwargs)
        if self.tool_parser is not None and self.tool_parser.keeps_special_tokens and params.skip_special_tokens:
            params.skip_special_tokens = False  # its marker is a control token
        return params

    def chat_options(self, chat_template: str | None = None,
                     base_kwargs: Mapping[str, Any] | None = None) -> ChatTemplateOptions:
        """How to render this request's messages: `chat_template` (None: the model's), the request's
        template fields over `base_kwargs`; a 400 naming the field at fault."""
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise bad_request("continue_final_message needs the last message to be the assistant's",
                              "continue_final_message")
        try:
            return ChatTemplateOptions(chat_template, self.add_generation_prompt, self.continue_final_message,
                                       {**(base_kwargs or {}), **(self.chat_template_kwargs or {})},
                                       tools=self._tool_request.tools if self._tool_request is not None else None)
        except ValueError as exc:
            field = "chat_template_kwargs" if "chat_template_kwargs" in str(exc) else "continue_final_message"
            raise bad_request(str(exc), field) from None

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
        return template_messages([m.to_template(i) for i, m in enumerate(self.messages)])


class CompletionRequest(_SamplingRequest):
    LOGPROBS_FIELD: ClassVar[str] = "logprobs"
    prompt: Str | list[Str] | list[Int] | list[list[Int]]
    max_tokens: Int | None = 16  # OpenAI's (and vLLM's) default for completions
    logprobs: Int | None = None
    echo: Bool = False  # the prompt before the completion, in the text and (with logprobs) the logprobs

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
    """The body as a JSON object, or an APIError (400) naming `body` (not a JSON object, nested too
    deep, not JSON) or a string's path (`messages[0].content`) when it holds a lone surrogate."""
    if isinstance(body, dict):
        raw = body
        check_json_value(raw)
    else:
        raw = load_json_body(body)
    if not isinstance(raw, dict):
        raise bad_request("the request body must be a JSON object", "body", "invalid_json")
    return raw


def parse_request(body: bytes | str | dict, model: type[_SamplingRequest]) -> _SamplingRequest:
    """The body (JSON text or an already parsed object) as `model`, or an APIError (400) naming the
    first field at fault (`body` itself when it is not a JSON object, nests too deep or is not JSON;
    a string's path, `messages[0].content`, when it holds a lone surrogate)."""
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


def sampling_params_from_body(request: _SamplingRequest, default_max_tokens: int | None = None,
                              defaults: Mapping[str, Any] | None = None) -> SamplingParams:
    """SamplingParams for a parsed request (parse_request), with OpenAI's defaults for unset fields, or
    the server's `defaults` (the model's generation_config.json: engine/text/generation_config.py).

    `default_max_tokens` applies when the body sets no completion budget (chat's max_tokens and
    max_completion_tokens are optional; the server passes what is left of the context), capped by
    `defaults`' max_tokens (generation_config.json's max_new_tokens) when there is one. A bad value,
    or none at all, is an APIError (400) naming the request's own field (`top_logprobs`,
    `max_completion_tokens`, ...).
    """
    request.check_combinations()
    max_tokens, max_tokens_field = request.requested_max_tokens()
    if max_tokens is None:
        candidates = [v for v in (default_max_tokens, (defaults or {}).get("max_tokens")) if v is not None]
        max_tokens = min(candidates) if candidates else None
    if max_tokens is None:
        raise bad_request(f"{max_tokens_field} is required", max_tokens_field, "missing_required_parameter")
    return request.sampling_params(max_tokens, request.num_logprobs(), request.LOGPROBS_FIELD, max_tokens_field,
                                   defaults)


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
