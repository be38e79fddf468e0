"""A batch file's line -> a request: its url picks the endpoint, its body the prompt and every setting.

The line's format and its request are openai/batch_format.py's (the body read with the server's request
models, so a batch line accepts exactly what `POST /v1/chat/completions` or `/v1/completions` accepts and
refuses the same fields by name: `tools`, `response_format`, `logit_bias`, ...). Differences, each on
purpose:
- a sampling field the body leaves out takes the job's `sampling` section (the job file is where a
  batch's defaults live; its temperature is 0 unless set), not OpenAI's default;
- `model` picks one of the job's LoRA adapters (model.lora_modules) by its name, as the server's
  `model` does; any other name is ignored: the job's model.path (or the job's one adapter) runs the line,
  whatever model it names (batch files written for OpenAI name OpenAI's models), and each response
  names the model that ran;
- `stream` and `stream_options` are refused (a batch has nothing to stream to);
- a body with `seed` draws its samples by (seed, sample index), as the server does, so a line gives
  what the same body sent to `batchgen serve` gives; without one, by (sampling.seed, custom_id,
  sample index), the pipeline's rule;
- a completions line holds one prompt (a string, or token ids), not a list of prompts.
Whatever is wrong inside a line is that line's error row, naming the field (`param`: a body field
by its name, as the server names it, or `method`, `url`, `body` for the line's own keys).
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

from batchgen.engine.config import SettingError
from batchgen.openai.api_error import APIError
from batchgen.openai.batch_format import endpoint_of, line_request, one_prompt
from batchgen.pipeline.batch_file import BATCH_ID_COLUMN, BATCH_LINE_COLUMN
from batchgen.pipeline.config import JobConfig
from batchgen.pipeline.request_builder import OpenAIRequest, RowError, RowInput

# Body fields that are SamplingParams fields of the same name and meaning.
_SAME_NAME = ("n", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
              "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "include_stop_str_in_output",
              "thinking_token_budget")


def decode_batch_lines(batch: pa.RecordBatch, job: JobConfig) -> list[RowInput]:
    """The rows of a batch of a batch file (columns custom_id, line), in order."""
    ids = batch.column(BATCH_ID_COLUMN).to_pylist()
    lines = batch.column(BATCH_LINE_COLUMN).to_pylist()
    return [decode_line(custom_id, line, job) for custom_id, line in zip(ids, lines)]


def decode_line(custom_id: str, line: bytes, job: JobConfig) -> RowInput:
    """One line (already known to be a JSON object with this custom_id) as a RowInput."""
    raw = json.loads(line)
    endpoint = endpoint_of(raw)
    try:
        return _decode(custom_id, raw, endpoint, job)
    except RowError as exc:
        code = "invalid_value" if exc.param is not None else None
        return RowInput(custom_id, error=str(exc), openai=OpenAIRequest(endpoint, exc.param, code))
    except APIError as exc:  # the server's models' verdict on the body
        return RowInput(custom_id, error=exc.message, openai=OpenAIRequest(endpoint, exc.param, exc.code))


def _decode(custom_id: str, raw: dict, endpoint: str | None, job: JobConfig) -> RowInput:
    request = line_request(raw)
    if endpoint == "chat":  # its tools and tool_choice, read with the job's model.tool_call_parser
        request.bind_tools(job.model.tool_call_parser)
    overrides, fields = _overrides(request, endpoint)
    try:
        params = job.sampling_params(**overrides)
    except SettingError as exc:
        field = fields.get(exc.name, exc.name)
        hint = ""
        if exc.name == "n" and "temperature" not in request.model_fields_set:
            hint = (f" (the body sets no temperature, so the job's sampling.temperature "
                    f"{job.sampling.temperature} applies)")
        raise RowError(f"{field} {exc.rule}; got {exc.value!r}{hint}", field) from None
    if params.thinking_token_budget is not None and job.model.reasoning_parser is None:
        raise RowError("thinking_token_budget needs the job's model.reasoning_parser", "thinking_token_budget")
    prompt = request.template_messages() if endpoint == "chat" else one_prompt(request)
    # A chat line's own template fields (vLLM's) over the job's input.chat_template(_kwargs).
    chat = request.chat_options(job.input.chat_template, job.input.chat_template_kwargs) \
        if endpoint == "chat" else None
    seeded = "seed" in request.model_fields_set and request.seed is not None
    adapter = request.model if request.model in job.model.lora_modules else None
    return RowInput(custom_id, prompt, overrides, num_prompt_bytes=_num_bytes(prompt), params=params,
                    sample_key="" if seeded else None,
                    openai=OpenAIRequest(endpoint, structured_param=fields.get("structured_outputs")), chat=chat,
                    tool_parser=request.tool_parser if endpoint == "chat" else None,
                    lora_name=adapter)


def _overrides(request, endpoint: str) -> tuple[dict[str, Any], dict[str, str]]:
    """(SamplingParams fields the body sets, the body field each came from where the name differs)."""
    given = request.model_fields_set
    overrides = {name: getattr(request, name) for name in _SAME_NAME
                 if name in given and getattr(request, name) is not None}
    fields: dict[str, str] = {}
    if "stop" in given and request.stop is not None:
        overrides["stop"] = [request.stop] if isinstance(request.stop, str) else list(request.stop)
    if endpoint == "chat":
        max_tokens, field = request.requested_max_tokens()
        if max_tokens is not None:
            overrides["max_tokens"], fields["max_tokens"] = max_tokens, field
        if given & {"logprobs", "top_logprobs"}:
            overrides["logprobs"] = request.num_logprobs()  # None, 0 or top_logprobs
            fields["logprobs"] = "top_logprobs" if request.top_logprobs else "logprobs"
    else:
        if "max_tokens" in given and request.max_tokens is not None:
            overrides["max_tokens"] = request.max_tokens
        if "logprobs" in given:
            overrides["logprobs"] = request.logprobs
    constraint, field = request.structured()  # a body's constraint replaces the job's sampling.structured
    if constraint is not None:
        overrides["structured_outputs"], fields["structured_outputs"] = constraint, field
    return overrides, fields


def _num_bytes(prompt: str | list) -> int:
    if isinstance(prompt, str):
        return len(prompt.encode())
    if all(isinstance(t, int) for t in prompt):
        return 4 * len(prompt)
    return sum(len(m["role"].encode()) + len(m["content"].encode()) for m in prompt)
