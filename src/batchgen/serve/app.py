"""The FastAPI app: OpenAI's /v1/models, /v1/chat/completions, /v1/completions, plus /health and /metrics.

A request's body is read up to --max-request-body-bytes (413 past it, before the rest is read),
checked field by field (protocol.py: types, nesting, text), admitted under the in-flight bound (else
503 with Retry-After), then handed to the engine thread (engine_loop.py), which encodes its
prompt(s), checks their length and queues one engine request per prompt; a large prompt is encoded
first on the encoder's own thread (prompt_encoder.py), so it holds up neither the engine nor the
event loop. Non-streaming handlers wait for
every prompt's Finished event, streaming ones relay each step's text as server-sent events. A
client that goes away aborts its engine requests, which gives their KV blocks back at once.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from batchgen.engine import LLMEngine, RequestOutput, SamplingParams
from batchgen.engine.text.chat_template import DEFAULT_CHAT, ChatTemplateOptions
from batchgen.openai.api_error import APIError, bad_request
from batchgen.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
    sampling_params_from_body,
)
from batchgen.openai.structured_fields import compile_request_constraint
from batchgen.serve import responses
from batchgen.serve.engine_loop import Admitted, EngineLoop, EventSink, Failed, Finished, Progress, Submission
from batchgen.serve.metrics import Metrics
from batchgen.serve.pooling_routes import add_pooling_routes
from batchgen.serve.prompt_encoder import PromptEncoder, encode_prompt, is_large, is_token_ids
from batchgen.serve.request_body import TooLarge, body_too_large, read_body
from batchgen.serve.request_bounds import (
    chat_body_too_large,
    check_prompt_bytes,
    check_prompt_logprob_entries,
    max_chat_body_bytes,
    messages_text,
    num_sequences,
)
from batchgen.serve.settings import DEFAULT_MAX_REQUEST_BODY_BYTES
from batchgen.serve.tokenizer_routes import add_tokenizer_routes

log = logging.getLogger("batchgen.serve")

RETRY_AFTER_S = 1  # what a 503 tells the client to wait before trying again


@dataclass
class ServerSettings:
    served_model_names: list[str]
    model_path: str  # what was loaded (/v1/models' `root`)
    api_key: str | None = None
    max_in_flight: int = 1024  # HTTP requests admitted at once (running or waiting); more get 503
    max_in_flight_seqs: int = 16384  # their sequences (prompts x n or beams); more get 429
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES  # a larger body gets 413
    chat_template: str | None = None  # --chat-template's text; None: the model's own
    chat_template_kwargs: dict = field(default_factory=dict)  # a job file's input.chat_template_kwargs
    seed: int | None = None  # --seed: unseeded requests keyed by (seed, arrival number), not at random
    sampling_defaults: dict = field(default_factory=dict)  # from generation_config.json (--generation-config)
    tool_call_parser: str | None = None  # --tool-call-parser: tool calls read from (and forced in) its format
    enable_auto_tool_choice: bool = False  # --enable-auto-tool-choice: tool_choice auto allowed
    lora_requests: dict = field(default_factory=dict)  # --lora-modules: name -> LoRARequest


@dataclass
class ServerState:
    loop: EngineLoop
    settings: ServerSettings
    metrics: Metrics
    max_model_len: int
    vocab_size: int
    encoder: PromptEncoder | None = None  # large prompts' thread; None: every prompt on the engine thread
    max_prompt_bytes: int | None = None  # the longest text a prompt of max_model_len tokens can be; None: unchecked
    health_stall_timeout: float = 120.0  # /health fails when the engine has work and has not stepped for this long
    in_flight: int = 0
    in_flight_seqs: int = 0
    shutting_down: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    num_unseeded: int = 0  # unseeded requests so far (with --seed, each one's sample key)

    def unseeded_sample_key(self) -> str:
        """The sample key of a request without a seed: random, or with --seed the server's seed and the
        request's arrival number, so the same requests sent in the same order after a restart draw alike."""
        if self.settings.seed is None:
            return uuid.uuid4().hex
        self.num_unseeded += 1
        return f"server-seed-{self.settings.seed}/{self.num_unseeded}"

    def admit(self, num_seqs: int = 1) -> Callable[[], None]:
        """Count one more request of `num_seqs` sequences in flight, or refuse it: 503 past the request
        bound, 429 past the sequence bound (both with Retry-After), 400 for a request larger than the
        sequence bound alone. Returns the idempotent release."""
        max_seqs = self.settings.max_in_flight_seqs
        if num_seqs > max_seqs:
            self.metrics.count_rejected()
            raise bad_request(f"this request holds {num_seqs:,} sequences (prompts x n, or beams); this server "
                              f"holds at most {max_seqs:,} at once (--max-queued-sequences)", "n", "too_many_sequences")
        if self.shutting_down:
            self.metrics.count_rejected()
            raise APIError(503, "the server is shutting down", code="shutdown")
        if self.in_flight >= self.settings.max_in_flight:
            self.metrics.count_rejected()
            raise APIError(503, f"the server holds {self.in_flight} requests, its bound (--max-queued-requests "
                                "plus --max-num-seqs); retry later", code="server_overloaded",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        if self.in_flight_seqs + num_seqs > max_seqs:
            self.metrics.count_rejected()
            raise APIError(429, f"the server holds {self.in_flight_seqs:,} sequences; {num_seqs:,} more would pass "
                                f"its bound of {max_seqs:,} (--max-queued-sequences); retry later",
                           code="too_many_sequences", headers={"Retry-After": str(RETRY_AFTER_S)})
        self.in_flight += 1
        self.in_flight_seqs += num_seqs
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.in_flight -= 1
                self.in_flight_seqs -= num_seqs
        return release


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="batchgen", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.batchgen = state
    names = state.settings.served_model_names
    adapters = state.settings.lora_requests
    model_names = names + [name for name in adapters if name not in names]  # what `model` may name

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(_ClientGone)
    async def _client_gone(_: Request, exc: _ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's code for "client closed request"

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        error = APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")
        return JSONResponse(error.body, status_code=500)

    @app.get("/health")
    async def health() -> Response:
        if not state.loop.is_alive:
            return JSONResponse(APIError(503, "the engine thread has stopped", code="engine_dead").body, 503)
        if state.loop.is_stalled(state.health_stall_timeout):
            stalled_s = state.loop.seconds_without_progress()
            return JSONResponse(APIError(503, f"the engine has work and has not finished a step for {stalled_s:.0f} s "
                                              f"(--health-stall-timeout {state.health_stall_timeout:g})",
                                         code="engine_stalled").body, 503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        _check_key(request, state.settings.api_key)
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": state.created, "owned_by": "batchgen",
             "root": state.settings.model_path, "parent": None, "max_model_len": state.max_model_len}
            for name in names] + [
            {"id": name, "object": "model", "created": state.created, "owned_by": "batchgen",
             "root": lora.lora_path, "parent": names[0], "max_model_len": state.max_model_len}
            for name, lora in adapters.items()]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        _check_key(request, state.settings.api_key)
        body = parse_request(await read_body(request, *_chat_body_bound(state)), ChatCompletionRequest)
        _check_model(body.model, model_names)
        body.bind_tools(state.settings.tool_call_parser, state.settings.enable_auto_tool_choice)
        messages = body.template_messages()
        if state.max_prompt_bytes is not None:  # before the template and the tokenizer see it
            check_prompt_bytes(messages_text(messages), "messages", state.max_prompt_bytes, state.max_model_len)
        chat = body.chat_options(state.settings.chat_template, state.settings.chat_template_kwargs)
        return await _generate(state, request, body, [messages], is_chat=True, chat=chat)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        _check_key(request, state.settings.api_key)
        body = parse_request(await read_body(request, state.settings.max_request_body_bytes),
                             CompletionRequest)
        _check_model(body.model, model_names)
        return await _generate(state, request, body, body.prompts(), is_chat=False)

    add_tokenizer_routes(app, state, lambda request: _check_key(request, state.settings.api_key))
    if state.loop.engine.is_pooling:  # a sequence classifier: /classify and /pooling, as vLLM's
        add_pooling_routes(app, state, lambda request: _check_key(request, state.settings.api_key),
                           lambda model: _check_model(model, names), _Tracker)
    return app


def _chat_body_bound(state: ServerState) -> tuple[int, TooLarge | None]:
    """The most bytes a chat body may have, and the error past it: the server's --max-request-body-bytes,
    or less where no body that long could hold a prompt that fits the context (refused before it is read)."""
    max_bytes = state.settings.max_request_body_bytes
    if state.max_prompt_bytes is None or max_chat_body_bytes(state.max_prompt_bytes) >= max_bytes:
        return max_bytes, None
    def too_large(num_bytes: int | None, bound: int) -> APIError:
        if num_bytes is not None and num_bytes > max_bytes:  # past the server's own limit too: its 413
            return body_too_large(num_bytes, max_bytes)
        return chat_body_too_large(num_bytes, bound, state.max_model_len)
    return max_chat_body_bytes(state.max_prompt_bytes), too_large


def _check_key(request: Request, api_key: str | None) -> None:
    if api_key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
    # The scheme is case-insensitive (RFC 7235: "bearer", "BEARER"); the key is compared in constant
    # time: how much of a guess matches must not show in how long the answer takes.
    is_key = hmac.compare_digest(given.strip().encode(), api_key.encode())
    if scheme.lower() != "bearer" or not is_key:
        raise APIError(401, "invalid or missing API key (send Authorization: Bearer KEY)", code="invalid_api_key")


def _check_model(model: str | None, names: list[str]) -> None:
    if model is not None and model not in names:
        raise bad_request(f"the model {model!r} is not served here; this server serves {', '.join(names)}",
                          "model", "model_not_found")


def _prepare(body: ChatCompletionRequest | CompletionRequest, prompt, prompt_field: str, state: ServerState,
             chat: ChatTemplateOptions = DEFAULT_CHAT):
    """What the engine thread runs for one prompt: its token ids and SamplingParams, or a 400.
    `prompt` is text or chat messages (encoded here, rendered as `chat` says), or token ids (a large
    prompt arrives encoded)."""

    def prepare(engine: LLMEngine) -> tuple[list[int], SamplingParams]:
        token_ids = prompt if is_token_ids(prompt) else encode_prompt(engine.tokenizer, prompt, prompt_field, chat)
        token_ids, params = _check_prompt(body, token_ids, prompt_field, state)
        compile_request_constraint(engine, body, params)  # a schema the grammar library refuses: 400
        return token_ids, params
    return prepare


def _check_prompt(body, token_ids: list[int], prompt_field: str,
                  state: ServerState) -> tuple[list[int], SamplingParams]:
    """The prompt's length (first: a huge one is refused before anything walks it) and token ids,
    and the request's SamplingParams with the completion budget the context leaves; else a 400."""
    max_model_len, vocab_size = state.max_model_len, state.vocab_size
    if not token_ids:
        raise bad_request(f"{prompt_field} is empty", prompt_field)
    if len(token_ids) >= max_model_len:
        raise bad_request(f"this model's maximum context length is {max_model_len} tokens; the "
                          f"{prompt_field} has {len(token_ids)}", prompt_field, "context_length_exceeded")
    if any(t < 0 or t >= vocab_size for t in token_ids):
        raise bad_request(f"{prompt_field} holds token ids outside [0, {vocab_size})", prompt_field)
    check_prompt_logprob_entries(len(token_ids), body.num_prompt_logprobs(), body.prompt_logprobs_field())
    params = sampling_params_from_body(body, default_max_tokens=max_model_len - len(token_ids),
                                       defaults=state.settings.sampling_defaults)
    if len(token_ids) + params.max_tokens > max_model_len:
        _, max_tokens_field = body.requested_max_tokens()
        raise bad_request(f"this model's maximum context length is {max_model_len} tokens; you asked for "
                          f"{len(token_ids) + params.max_tokens} ({len(token_ids)} in the {prompt_field}, "
                          f"{params.max_tokens} in {max_tokens_field})", max_tokens_field,
                          "context_length_exceeded")
    return list(token_ids), params


async def _generate(state: ServerState, request: Request, body, prompts: list, is_chat: bool,
                    chat: ChatTemplateOptions = DEFAULT_CHAT) -> Response:
    # A bad field is a 400 before any queueing (the default budget is settled per prompt later).
    params = sampling_params_from_body(body, default_max_tokens=state.max_model_len,
                                       defaults=state.settings.sampling_defaults)
    # The constraint compiled here, on a worker thread, not on the engine thread that steps everyone's
    # requests (a large schema takes seconds); the engine thread then finds it in the compiler's cache.
    await asyncio.to_thread(compile_request_constraint, state.loop.engine, body, params)
    if state.max_prompt_bytes is not None and not is_chat:  # before anything tokenizes them
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                check_prompt_bytes(prompt, "prompt" if len(prompts) == 1 else f"prompt[{i}]", state.max_prompt_bytes,
                                   state.max_model_len)
    release = state.admit(num_sequences(params, len(prompts)))
    try:
        response_id = f"{'chatcmpl' if is_chat else 'cmpl'}-{uuid.uuid4().hex}"
        request_ids = [f"{response_id}-{i}" for i in range(len(prompts))]
        sink = EventSink()
        # Seeded: samples keyed by (seed, index) alone, the same on every call; else a random key
        # (with --seed, one made of the server's seed and the request's arrival number).
        sample_key = "" if body.seed is not None else state.unseeded_sample_key()
        prompt_field = "messages" if is_chat else "prompt"
        field_names = [prompt_field if len(prompts) == 1 or is_chat else f"prompt[{i}]"
                       for i in range(len(prompts))]
        if state.encoder is not None:  # large prompts: encoded and checked here, off the engine thread
            prompts = [_check_prompt(body, await state.encoder.encode(p, name, chat), name, state)[0]
                       if is_large(p) else p for p, name in zip(prompts, field_names)]
        for request_id, prompt, field_name in zip(request_ids, prompts, field_names):
            state.loop.submit(Submission(request_id, _prepare(body, prompt, field_name, state, chat), sample_key,
                                         sink, body.stream, echo=getattr(body, "echo", False),
                                         lora_request=state.settings.lora_requests.get(body.model)))
        tracker = _Tracker(state.loop, request_ids, sink)
        buffered = await tracker.admitted(request)
        model = body.model or state.settings.served_model_names[0]
        if body.stream:
            writer = responses.ChunkWriter(is_chat, response_id, int(time.time()), model, body.n,
                                           body.include_usage, getattr(body, "tool_parser", None))
            stream = _stream(tracker, writer, buffered, len(prompts))
            return _ClosingStream(stream, media_type="text/event-stream",
                                  on_close=lambda: (tracker.abort_unfinished(), release()))
        outputs = await tracker.wait_finished(request, buffered)
    except BaseException:
        release()
        raise
    release()
    outputs_in_order = [outputs[r] for r in request_ids]
    build = responses.chat_completion if is_chat else responses.completion
    echo = {} if is_chat else {"echo": body.echo, "is_echo_only": body.is_echo_only}
    if is_chat:
        echo = {"tool_parser": body.tool_parser}
    return JSONResponse(build(response_id, int(time.time()), model, [o.output for o in outputs_in_order],
                              [o.deltas for o in outputs_in_order], body.n,
                              prompts=[o.prompt for o in outputs_in_order], **echo))


class _Tracker:
    """The engine requests of one HTTP request: waits on their events, aborts what is left."""

    def __init__(self, loop: EngineLoop, request_ids: list[str], sink: EventSink):
        self.loop, self.request_ids, self.sink = loop, request_ids, sink
        self.index = {r: i for i, r in enumerate(request_ids)}
        self.unfinished = set(request_ids)

    def abort_unfinished(self) -> None:
        for request_id in self.unfinished:
            self.loop.abort(request_id)
        self.unfinished.clear()

    async def _next(self, request: Request | None):
        """The next event; _ClientGone when the client disconnects first."""
        if request is None:
            return await self.sink.get()
        get = asyncio.ensure_future(self.sink.get())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if get in done:
            return get.result()
        get.cancel()
        raise _ClientGone()

    async def admitted(self, request: Request) -> list:
        """Wait until the engine took every prompt; a refused one (e.g. overlong) raises its APIError.
        Returns the other events that arrived meanwhile, in order."""
        waiting, buffered = set(self.request_ids), []
        try:
            while waiting:
                event = await self._next(request)
                if isinstance(event, Admitted):
                    waiting.discard(event.request_id)
                elif isinstance(event, Failed):
                    self.unfinished.discard(event.request_id)
                    raise event.error
                else:
                    buffered.append(event)
        except BaseException:
            self.abort_unfinished()
            raise
        return buffered

    async def wait_finished(self, request: Request, buffered: list) -> dict[str, Finished]:
        outputs: dict[str, Finished] = {}
        pending = list(buffered)
        try:
            while self.unfinished:
                event = pending.pop(0) if pending else await self._next(request)
                if isinstance(event, Finished):
                    self.unfinished.discard(event.request_id)
                    outputs[event.request_id] = event
                elif isinstance(event, Failed):
                    self.unfinished.discard(event.request_id)
                    raise event.error
        except BaseException:
            self.abort_unfinished()
            raise
        return outputs


class _ClientGone(Exception):
    pass


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body is read: `receive` only reports that now)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


async def _stream(tracker: _Tracker, writer: responses.ChunkWriter, buffered: list,
                  num_prompts: int) -> AsyncIterator[str]:
    outputs: dict[str, RequestOutput] = {}
    if writer.is_chat:
        yield _sse(writer.role_chunk(num_prompts))
    pending = list(buffered)
    while tracker.unfinished:
        event = pending.pop(0) if pending else await tracker.sink.get()
        if isinstance(event, Progress):
            yield _sse(writer.delta_chunk(tracker.index[event.request_id], event.deltas))
        elif isinstance(event, Finished):
            tracker.unfinished.discard(event.request_id)
            outputs[event.request_id] = event.output
            yield _sse(writer.delta_chunk(tracker.index[event.request_id], event.deltas))
        elif isinstance(event, Failed):
            tracker.unfinished.discard(event.request_id)
            tracker.abort_unfinished()
            yield _sse({"error": event.error.body["error"]})
            yield _sse("[DONE]")
            return
    if writer.include_usage:
        yield _sse(writer.usage_chunk([outputs[r] for r in tracker.request_ids]))
    yield _sse("[DONE]")


class _ClosingStream(StreamingResponse):
    """A StreamingResponse that runs `on_close` however it ends (done, client gone, cancelled), even
    when the client left before the body started (the generator's own `finally` would not run)."""

    def __init__(self, content, media_type: str, on_close: Callable[[], object]):
        super().__init__(content, media_type=media_type, headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
