"""The server's engine thread under load, in process (the session's engine, no HTTP server): a flood of
submissions does not starve running requests' steps, and /health turns 503 while the engine is frozen
with work waiting, and 200 again once it steps."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx

from batchgen.engine import SamplingParams
from batchgen.serve.app import ServerSettings, ServerState, create_app
from batchgen.serve.engine_loop import Admitted, EngineLoop, EventSink, Failed, Finished, Submission
from batchgen.serve.metrics import Metrics


def _submission(request_id: str, sink: EventSink, max_tokens: int, delay_s: float = 0.0) -> Submission:
    def prepare(engine):
        time.sleep(delay_s)  # what encoding a large prompt costs the engine thread
        return engine.tokenizer.encode("Name a colour."), SamplingParams(max_tokens=max_tokens, temperature=0)
    return Submission(request_id, prepare, "", sink, is_streaming=False)


async def _next_of(sink: EventSink, kinds: tuple, timeout: float = 60.0):
    while True:
        event = await asyncio.wait_for(sink.get(), timeout)
        if isinstance(event, Failed):
            raise event.error
        if isinstance(event, kinds):
            return event


def test_a_flood_of_submissions_does_not_starve_running_requests(llm):
    loop = EngineLoop(llm.engine, Metrics("m"))
    loop.start()
    try:
        async def run() -> tuple[int, int]:
            running = EventSink()
            loop.submit(_submission("running", running, max_tokens=6))
            await _next_of(running, (Admitted,))
            flood = EventSink()
            num_flood = 400
            for i in range(num_flood):  # 400 x 10 ms of prompt work: 4 s on the engine thread
                loop.submit(_submission(f"flood-{i}", flood, max_tokens=1, delay_s=0.01))
            await _next_of(running, (Finished,))
            num_admitted_before = flood.queue.qsize()  # Admitted (and a few Finished) events so far
            for i in range(num_flood):
                await _next_of(flood, (Finished,))
            return num_admitted_before, num_flood

        num_admitted_before, num_flood = asyncio.run(run())
        # Draining the inbox first would admit all 400 before the running request's next step.
        assert num_admitted_before < num_flood / 2, num_admitted_before
    finally:
        loop.stop()


def test_health_is_503_while_the_engine_is_frozen_with_work(llm, monkeypatch):
    engine = llm.engine
    loop = EngineLoop(engine, Metrics("m"))
    state = ServerState(loop, ServerSettings(served_model_names=["m"], model_path="m"), Metrics("m"),
                        engine.max_model_len, engine.model_cfg.vocab_size, health_stall_timeout=0.5)
    frozen = threading.Event()
    original_step = engine.step

    def frozen_step():
        frozen.wait(30)  # a stuck kernel, a deadlock
        return original_step()
    monkeypatch.setattr(engine, "step", frozen_step)
    loop.start()
    try:
        async def run() -> list[int]:
            statuses = []
            transport = httpx.ASGITransport(app=create_app(state))
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
                statuses.append((await http.get("/health")).status_code)  # idle: healthy
                sink = EventSink()
                loop.submit(_submission("stuck", sink, max_tokens=2))
                await _next_of(sink, (Admitted,))
                await asyncio.sleep(1.0)
                stalled = await http.get("/health")
                statuses.append(stalled.status_code)
                assert stalled.json()["error"]["code"] == "engine_stalled"
                frozen.set()
                await _next_of(sink, (Finished,))
                statuses.append((await http.get("/health")).status_code)
            return statuses

        assert asyncio.run(run()) == [200, 503, 200]
    finally:
        frozen.set()
        loop.stop()
