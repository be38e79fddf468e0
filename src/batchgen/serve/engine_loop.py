"""EngineLoop: one thread owns the engine; HTTP handlers hand it requests and await its events.

Between two engine steps the thread takes every request that arrived (and every abort), so
concurrent HTTP requests share steps: continuous batching across clients. Everything that touches
the engine's tokenizer runs on this thread too (encoding small prompts, streaming text, token
strings for logprobs): a Rust tokenizer shared by two threads can fail with "Already borrowed".
Large prompts arrive already encoded, by the PromptEncoder's own copy (prompt_encoder.py).

Results go back to the asyncio side through each request's EventSink (call_soon_threadsafe onto an
asyncio.Queue): a streaming request asks the engine for DELTA outputs (SamplingParams.output_kind) and
gets a Progress event per step with the new text and tokens of its unfinished samples; every request
ends with one Finished (all its samples, or for a stream their last pieces) or one Failed event. A
request that fails (its prompt is refused, its output cannot be formatted) fails alone; a step that
raises fails the requests in the engine, and the loop goes on serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from batchgen.engine import (
    CompletionOutput,
    LLMEngine,
    PoolingRequestOutput,
    RequestOutput,
    SamplingParams,
    TopLogprob,
)
from batchgen.engine.config import SettingError
from batchgen.engine.core.outputs import PromptLogprobs, RequestOutputKind
from batchgen.openai.api_error import APIError
from batchgen.serve.metrics import EngineGauges, Metrics

log = logging.getLogger("batchgen.serve")

# How long the idle thread sleeps before looking again (a new request wakes it at once).
IDLE_WAIT_S = 0.5
# How long the thread spends on its inbox (encoding prompts, adding requests) before it steps again
# while requests run: a flood of submissions never starves the running ones' steps.
INBOX_BUDGET_S = 0.05


class TokenLogprob(NamedTuple):
    """A chosen token with its text (decoded alone), raw log-probability and the top-N alternatives."""

    token_id: int
    token: str
    logprob: float
    top: list[TopLogprob]


@dataclass
class SampleDelta:
    """What one sample added since its last delta (for a non-streaming request: the whole sample)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None  # None unless the request asked for logprobs
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # With a reasoning parser: the thinking and the answer of `text` (None: not split)
    reasoning: str | None = None
    content: str | None = None
    num_reasoning_tokens: int | None = None


@dataclass
class PromptEcho:
    """A request's prompt as the response shows it (echo, prompt_logprobs), made on the engine thread."""

    text: str  # the prompt as sent, or its tokens decoded (a token-id prompt)
    token_ids: list[int]
    tokens: list[str]  # each token's text decoded alone
    logprobs: list[TokenLogprob | None] | None  # None for the first token; None when not asked
    prompt_logprobs: PromptLogprobs | None  # vLLM's per-position {token id: Logprob}


def completion_delta(c: CompletionOutput, token_texts, text: str | None = None, start: int = 0,
                     end: int | None = None) -> SampleDelta:
    """A sample's tokens [start, end) (default: all, a finished sample whole) as a delta with `text`
    (default: the sample's): its logprob entries from the output itself (the tokens' texts from
    `token_texts`, Tokenizer.token_texts)."""
    token_ids = list(c.token_ids[start:end])
    logprobs = None
    if c.logprobs is not None:
        tops = c.top_logprobs[start:end] if c.top_logprobs else [[] for _ in token_ids]
        logprobs = [TokenLogprob(t, token, lp, list(top))
                    for t, token, lp, top in zip(token_ids, token_texts(token_ids), c.logprobs[start:end], tops)]
    return SampleDelta(c.index, c.text if text is None else text, token_ids, logprobs, c.finish_reason,
                       c.stop_reason, c.reasoning_content, c.content, c.num_reasoning_tokens)


def prompt_echo(out: RequestOutput, tokenizer) -> PromptEcho:
    """The prompt of a finished request as text, tokens and (when asked) log-probabilities."""
    ids = list(out.prompt_token_ids)
    text = out.prompt if out.prompt is not None else tokenizer.decode(ids, skip_special_tokens=False)
    tokens = tokenizer.token_texts(ids)
    logprobs = None
    if out.prompt_logprobs is not None:
        logprobs = [None]
        for token_id, token, position in zip(ids[1:], tokens[1:], out.prompt_logprobs[1:]):
            chosen = position[token_id]
            top = [TopLogprob(t, lp.decoded_token, lp.logprob) for t, lp in position.items() if t != token_id]
            logprobs.append(TokenLogprob(token_id, token, chosen.logprob, top))
    return PromptEcho(text, ids, tokens, logprobs, out.prompt_logprobs)


@dataclass
class Admitted:
    """The engine took the request (its prompt and settings passed every check)."""

    request_id: str


@dataclass
class Progress:
    request_id: str
    deltas: list[SampleDelta]


@dataclass
class Finished:
    request_id: str
    output: RequestOutput
    deltas: list[SampleDelta]  # one per sample: the whole sample, or what a stream has not sent yet
    prompt: PromptEcho | None = None  # when the request echoes its prompt or asked prompt_logprobs


@dataclass
class Failed:
    request_id: str
    error: APIError


Event = Admitted | Progress | Finished | Failed


class EventSink:
    """A request's (or a group of requests') events, on the asyncio loop that created it."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Event] = asyncio.Queue()

    def put(self, event: Event) -> None:
        """Thread-safe; dropped when the event loop has closed (nobody is listening any more)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:
            pass

    async def get(self) -> Event:
        return await self.queue.get()


# Runs on the engine thread: the prompt's token ids and the request's SamplingParams, or an APIError.
Prepare = Callable[[LLMEngine], tuple[list[int], SamplingParams]]


@dataclass
class Submission:
    request_id: str
    prepare: Prepare
    sample_key: str  # "" keys samples by (seed, index) alone; a random string for unseeded requests
    sink: EventSink
    is_streaming: bool
    arrival_time: float = field(default_factory=time.monotonic)  # when the HTTP request arrived
    echo: bool = False  # the response shows the prompt (completions' echo)
    lora_request: object | None = None  # the LoRARequest `model` named (--lora-modules); None: the base


@dataclass
class _Record:
    submission: Submission
    num_samples: int
    output: RequestOutput | None = None  # a stream's DELTA outputs so far, joined (RequestOutput.add)
    # a stream's sample index -> (chars, tokens, reasoning chars, answer chars) sent
    sent: dict[int, tuple[int, int, int, int]] = field(default_factory=dict)


class EngineLoop:
    def __init__(self, engine: LLMEngine, metrics: Metrics):
        self.engine = engine
        self.metrics = metrics
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._fail_at: float | None = None  # monotonic deadline after which every request fails
        self._records: dict[str, _Record] = {}
        self._last_progress = time.monotonic()  # when the thread last finished a step or found nothing to do
        self._thread = threading.Thread(target=self._run, name="batchgen-engine", daemon=True)

    # ---- called from the asyncio side (any thread) ------------------------------------------------
    def start(self) -> None:
        self._publish()
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def is_stalled(self, timeout_s: float) -> bool:
        """The engine has requests (or an inbox) and its thread has not finished a step for `timeout_s`."""
        has_work = bool(self._records) or not self._inbox.empty()
        return has_work and self.seconds_without_progress() > timeout_s

    def seconds_without_progress(self) -> float:
        """How long the engine thread has gone without finishing a step while it had work (0 when idle
        or stepping): what /health reads to tell a stuck engine from a busy one."""
        return time.monotonic() - self._last_progress

    def submit(self, submission: Submission) -> None:
        self._inbox.put(("add", submission))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """Drop a request (a client went away); nothing more is sent for it. Harmless once finished."""
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def call(self, fn: Callable[[LLMEngine], object]) -> asyncio.Future:
        """Run `fn(engine)` on the engine thread between two steps (the tokenizer is used there only);
        the future (of the calling event loop) gets its result or its exception."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._inbox.put(("call", (fn, future, loop)))
        self._wake.set()
        return future

    def fail_all_after(self, seconds: float) -> None:
        """Shutdown: requests still unfinished `seconds` from now end with an error. Signal-safe."""
        self._fail_at = time.monotonic() + seconds
        self._wake.set()

    # ---- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self._iterate()
            except Exception as exc:  # a bug outside the step: fail what is in flight, keep serving
                log.exception("engine loop error")
                self._fail_all(APIError(500, f"internal error: {type(exc).__name__}: {exc}",
                                        code="internal_error"))
        self._take_inbox()
        self._fail_all(APIError(503, "the server stopped before this request finished", code="shutdown"))

    def _iterate(self) -> None:
        self._take_inbox(INBOX_BUDGET_S)
        if self._fail_at is not None and time.monotonic() >= self._fail_at and self._records:
            self._fail_all(APIError(503, "the server shut down before this request finished", code="shutdown"))
        if not self.engine.has_unfinished():
            self._publish()
            self._last_progress = time.monotonic()
            if self._inbox.empty():  # else the budget cut the inbox short: take the rest at once
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()
                self._last_progress = time.monotonic()
            return
        try:
            outputs = self.engine.step()  # finished requests, and streams' DELTA outputs
        except Exception as exc:
            log.exception("engine step failed")
            self._fail_all(APIError(500, f"the engine failed: {type(exc).__name__}: {exc}", code="engine_error"))
            return
        finally:
            self._last_progress = time.monotonic()
        self._emit(outputs)
        self._publish()

    def _take_inbox(self, budget_s: float | None = None) -> None:
        """Add, abort and call what arrived, in order; with `budget_s`, stop once that long has passed
        (the rest waits for the next step: requests already running keep stepping under a flood)."""
        deadline = None if budget_s is None else time.monotonic() + budget_s
        num_aborted = 0
        while deadline is None or time.monotonic() < deadline:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                self._add(item)
            elif kind == "call":
                self._call(*item)
            elif kind == "abort" and item in self._records:
                record = self._records.pop(item)
                self.engine.abort_request(item)
                self.metrics.count_end("abort", record.num_samples)
                num_aborted += 1
        if num_aborted:
            self._publish()  # the freed blocks show now, not after the next step

    def _call(self, fn, future: asyncio.Future, loop: asyncio.AbstractEventLoop) -> None:
        try:
            result, error = fn(self.engine), None
        except Exception as exc:  # the caller's to report
            result, error = None, exc

        def settle() -> None:
            if not future.done():
                future.set_exception(error) if error is not None else future.set_result(result)
        try:
            loop.call_soon_threadsafe(settle)
        except RuntimeError:  # that event loop has closed: nobody waits
            pass

    def _add(self, sub: Submission) -> None:
        if self._fail_at is not None and time.monotonic() >= self._fail_at:
            sub.sink.put(Failed(sub.request_id, APIError(503, "the server is shutting down", code="shutdown")))
            return
        try:
            token_ids, params = sub.prepare(self.engine)
            if params is None:  # a pooling model's request (pooling_routes.py): scored, nothing sampled
                self.engine.add_pooling_request(sub.request_id, token_ids)
                self._records[sub.request_id] = _Record(sub, 1)
                sub.sink.put(Admitted(sub.request_id))
                return
            if sub.is_streaming:  # each step's new tokens and text come back from the engine
                params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
            self.engine.add_request(sub.request_id, None, params, prompt_token_ids=token_ids,
                                    sample_key=sub.sample_key, lora_request=sub.lora_request)
        except APIError as exc:
            sub.sink.put(Failed(sub.request_id, exc))
            return
        except ValueError as exc:  # the engine's own checks (vocabulary): this request only
            param = exc.name if isinstance(exc, SettingError) else None  # a SamplingParams field: the body's
            sub.sink.put(Failed(sub.request_id, APIError(400, str(exc), param, code="invalid_value")))
            return
        except Exception as exc:
            log.exception("cannot add request %s", sub.request_id)
            error = APIError(500, f"cannot add the request: {exc}", code="engine_error")
            sub.sink.put(Failed(sub.request_id, error))
            return
        self._records[sub.request_id] = _Record(sub, params.n)
        sub.sink.put(Admitted(sub.request_id))

    def _emit(self, outputs: list[RequestOutput]) -> None:
        """The step's outputs as events: a non-streaming request's when it finished, a stream's (DELTA)
        each step it advanced."""
        for out in outputs:
            record = self._records.get(out.request_id)
            if record is None:  # failed or aborted meanwhile
                continue
            try:
                if record.submission.is_streaming:
                    record.output = out if record.output is None else record.output.add(out)
                if out.finished:
                    self._finish(record, record.output or out)
                else:
                    self._progress(record, out)
            except Exception as exc:  # formatting this request failed: it alone fails
                log.exception("cannot emit request %s", out.request_id)
                self._records.pop(out.request_id, None)
                self.engine.abort_request(out.request_id)
                self.metrics.count_end("error", record.num_samples)
                record.submission.sink.put(Failed(out.request_id, APIError(500, f"internal error: {exc}",
                                                                          code="internal_error")))

    def _finish(self, record: _Record, out: RequestOutput) -> None:
        """The request's whole output: each sample whole, or for a stream what it has not sent yet."""
        del self._records[out.request_id]
        if isinstance(out, PoolingRequestOutput):  # its data is the whole answer
            self.metrics.count_end("stop", 1)
            record.submission.sink.put(Finished(out.request_id, out, []))
            return
        failed = next((c for c in out.outputs if c.finish_reason == "error"), None)
        if failed is not None:  # one sample failed alone in the engine (its grammar): this request's error
            self.metrics.count_end("error", record.num_samples)
            record.submission.sink.put(Failed(out.request_id, APIError(
                500, f"sample {failed.index} failed: {failed.error}", code="generation_error")))
            return
        deltas = [self._unsent(record, c) if record.submission.is_streaming
                  else completion_delta(c, self.engine.tokenizer.token_texts) for c in out.outputs]
        prompt = None
        if record.submission.echo or out.prompt_logprobs is not None:
            prompt = prompt_echo(out, self.engine.tokenizer)
        self.metrics.record_finished(out, record.submission.arrival_time)
        record.submission.sink.put(Finished(out.request_id, out, deltas, prompt))

    def _progress(self, record: _Record, delta: RequestOutput) -> None:
        """What a stream's unfinished samples added: text (held back by the engine while a stop string
        may still cut it), and tokens once they have text or logprobs are asked. A sample that finished
        sends its last piece with the request's end."""
        joined = {c.index: c for c in record.output.outputs}
        deltas = []
        for c in delta.outputs:
            if c.finish_reason is None and (d := self._unsent(record, joined[c.index], is_finished=False)):
                deltas.append(d)
        if deltas:
            record.submission.sink.put(Progress(delta.request_id, deltas))

    def _unsent(self, record: _Record, c: CompletionOutput, is_finished: bool = True) -> SampleDelta | None:
        """The part of a stream's sample (joined so far) not sent yet; None when an unfinished one has
        nothing worth a chunk."""
        num_chars, num_tokens, num_reasoning, num_content = record.sent.get(c.index, (0, 0, 0, 0))
        text = c.text[num_chars:]
        if not is_finished and not text and (c.logprobs is None or num_tokens == len(c.token_ids)):
            return None
        record.sent[c.index] = (len(c.text), len(c.token_ids), len(c.reasoning_content or ""), len(c.content or ""))
        delta = completion_delta(c, self.engine.tokenizer.token_texts, text, num_tokens)
        if c.reasoning_content is not None:
            delta.reasoning = c.reasoning_content[num_reasoning:]
        if c.content is not None:
            delta.content = c.content[num_content:]
        return delta

    def _fail_all(self, error: APIError) -> None:
        if self._records:
            log.info("ending %d unfinished request(s): %s", len(self._records), error.message)
        for request_id, record in list(self._records.items()):
            try:
                self.engine.abort_request(request_id)
            except Exception:  # the engine's state may be what failed; the request ends regardless
                log.exception("cannot abort request %s", request_id)
            self.metrics.count_end("error", record.num_samples)
            record.submission.sink.put(Failed(request_id, error))
        self._records.clear()

    def _publish(self) -> None:
        scheduler, manager = self.engine.scheduler, self.engine.kv_cache_manager
        pool = manager.pool
        running = scheduler.running_request_ids()
        self.metrics.publish(EngineGauges(
            num_requests_running=len(running),
            num_requests_waiting=len(self._records) - len(running & self._records.keys()),
            num_free_blocks=pool.num_free_blocks, num_blocks=pool.num_blocks,
            num_prefix_queried_tokens=pool.num_queried_blocks * manager.block_size,
            num_prefix_hit_tokens=pool.num_hit_blocks * manager.block_size,
            num_preemptions=scheduler.stats.num_preemptions))
