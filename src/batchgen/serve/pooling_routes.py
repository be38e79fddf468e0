"""vLLM's pooling endpoints for a pooling model (a sequence classifier, e.g. a reward model):
`/classify` and `/pooling` (also under /v1/). Registered only when the server's model is one.

A body names its input as vLLM's do: `input` (a string, a list of strings, a list of token ids, or a
list of those) or `messages` (one conversation, rendered with the chat template without a generation
prompt: the whole exchange is scored); `truncate_prompt_tokens` keeps a prompt's last k tokens.
Each prompt is one engine request; the completions of a prompt share its KV through the prefix cache.

- `/classify`: `data[i]` = {index, label (config.json's id2label of the most likely class), probs (vLLM's
  classify activation: softmax over the labels, a sigmoid for one label), num_classes}.
- `/pooling`: `data[i]` = {index, object: "pooling", data}: the score head's raw logits at the last
  non-pad token (a reward model's reward), or with `"task": "classify"` the probabilities.
  `encoding_format` is "float" only.
Both answer `usage` {prompt_tokens, total_tokens, completion_tokens: 0}.
"""

from __future__ import annotations

import time
import uuid

from fastapi import FastAPI, Request
from pydantic import ValidationError

from batchgen.engine import LLMEngine
from batchgen.engine.pooling.outputs import POOLING_TASKS, classify_activation
from batchgen.engine.text.chat_template import ChatTemplateOptions
from batchgen.openai.api_error import bad_request
from batchgen.openai.protocol import ChatMessage, parse_json_object
from batchgen.serve.engine_loop import EventSink, Submission
from batchgen.serve.request_body import read_body


def add_pooling_routes(app: FastAPI, state, check_key, check_model, track) -> None:
    """Register /classify and /pooling (and their /v1/ twins) on `app`. `check_key(request)`,
    `check_model(name)`: the server's checks; `track(loop, request_ids, sink)`: app.py's _Tracker."""

    async def run(request: Request, kind: str) -> dict:
        check_key(request)
        body = parse_json_object(await read_body(request, state.settings.max_request_body_bytes))
        check_model(body.get("model"))
        task = "classify" if kind == "classify" else body.get("task", "reward")
        if task not in POOLING_TASKS:
            raise bad_request(f"task must be one of {', '.join(POOLING_TASKS)}", "task")
        if kind == "pooling" and body.get("encoding_format", "float") != "float":
            raise bad_request("encoding_format must be float", "encoding_format")
        prompts, field = _prompts(body)
        truncate = body.get("truncate_prompt_tokens")
        if truncate is not None and (not isinstance(truncate, int) or isinstance(truncate, bool) or truncate < 1):
            raise bad_request("truncate_prompt_tokens must be an integer >= 1", "truncate_prompt_tokens")
        chat = ChatTemplateOptions(state.settings.chat_template, add_generation_prompt=False,
                                   chat_template_kwargs=state.settings.chat_template_kwargs)
        release = state.admit()
        try:
            response_id = f"{'classify' if kind == 'classify' else 'pool'}-{uuid.uuid4().hex}"
            request_ids = [f"{response_id}-{i}" for i in range(len(prompts))]
            sink = EventSink()
            for i, (request_id, prompt) in enumerate(zip(request_ids, prompts)):
                name = field if len(prompts) == 1 else f"{field}[{i}]"
                state.loop.submit(Submission(request_id, _prepare(prompt, name, chat, truncate, state), "", sink,
                                             False))
            tracker = track(state.loop, request_ids, sink)
            buffered = await tracker.admitted(request)
            finished = await tracker.wait_finished(request, buffered)
        finally:
            release()
        outputs = [finished[r].output for r in request_ids]
        num_tokens = sum(len(out.prompt_token_ids) for out in outputs)
        labels = state.loop.engine.model_cfg.label_names
        data = []
        for i, out in enumerate(outputs):
            values = classify_activation(out.outputs.data) if task == "classify" else out.outputs.data
            if kind == "classify":
                probs = values.tolist()
                data.append({"index": i, "label": labels[int(values.argmax())] if labels else None, "probs": probs,
                             "num_classes": len(probs)})
            else:
                data.append({"index": i, "object": "pooling", "data": values.tolist()})
        return {"id": response_id, "object": "list", "created": int(time.time()),
                "model": body.get("model") or state.settings.served_model_names[0], "data": data,
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0,
                          "prompt_tokens_details": None}}

    for path in ("/classify", "/v1/classify"):
        app.post(path)(_bound(run, "classify"))
    for path in ("/pooling", "/v1/pooling"):
        app.post(path)(_bound(run, "pooling"))


def _bound(run, kind: str):
    async def route(request: Request) -> dict:
        return await run(request, kind)
    return route


def _prompts(body: dict) -> tuple[list, str]:
    """The body's prompts (text, token ids or one conversation) and the field they came from; else a 400."""
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list) or not messages:
            raise bad_request("messages must be a non-empty list of messages", "messages")
        try:
            conversation = [ChatMessage.model_validate(m).to_template(i) for i, m in enumerate(messages)]
        except ValidationError as exc:
            raise bad_request(f"messages: {exc.errors()[0]['msg']}", "messages") from None
        return [conversation], "messages"
    value = body.get("input")
    if isinstance(value, str) or _is_ids(value):
        return [value], "input"
    if isinstance(value, list) and value and all(isinstance(v, str) or _is_ids(v) for v in value):
        return list(value), "input"
    raise bad_request("input (a string, a list of strings, token ids or lists of them) or messages is required",
                      "input", "missing_required_parameter")


def _is_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


def _prepare(prompt, field: str, chat: ChatTemplateOptions, truncate: int | None, state):
    """What the engine thread runs: the prompt's token ids (no SamplingParams: a pooling request)."""

    def prepare(engine: LLMEngine) -> tuple[list[int], None]:
        if _is_ids(prompt):
            token_ids = list(prompt)
        else:
            try:
                token_ids = engine.encode(prompt, chat=chat)
            except ValueError as exc:
                raise bad_request(f"{field}: {exc}", field) from None
        if truncate is not None:
            token_ids = token_ids[-truncate:]
        if not token_ids:
            raise bad_request(f"{field} is empty", field)
        if len(token_ids) > state.max_model_len:
            raise bad_request(f"this model's maximum context length is {state.max_model_len} tokens; the {field} "
                              f"has {len(token_ids)}", field, "context_length_exceeded")
        if any(t < 0 or t >= state.vocab_size for t in token_ids):
            raise bad_request(f"{field} holds token ids outside [0, {state.vocab_size})", field)
        return token_ids, None
    return prepare
