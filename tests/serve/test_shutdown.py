"""SIGTERM during 8 streaming requests: short ones complete, long ones end with an error event, the
server stops accepting and exits 0 within --shutdown-timeout (plus the time to close)."""

from __future__ import annotations

import asyncio
import re
import signal
import time

import httpx
import openai
import pytest

from tests.conftest import MODEL
from tests.engine.prompts import QUESTIONS, chat
from tests.serve.server_process import ServerProcess

pytestmark = pytest.mark.server

SHUTDOWN_TIMEOUT_S = 8.0
# The HTTP side must be done within the grace period plus uvicorn's margin (2 s) and a step's time;
# the process exit (the engine thread, the interpreter's teardown) gets more on a busy machine.
HTTP_STOP_MARGIN_S = 6.0
EXIT_MARGIN_S = 30.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = ServerProcess(tmp_path_factory.mktemp("serve") / "server.log",
                           "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S))
    yield server.wait_ready()
    server.stop()


async def _stream(aclient: openai.AsyncOpenAI, question: str, max_tokens: int, started: asyncio.Event,
                  counter: list[int]) -> tuple[str, str]:
    """('done', finish_reason) or ('error', message); `started` is set once every stream has content."""
    stream = await aclient.chat.completions.create(model=MODEL, messages=chat(question), max_tokens=max_tokens,
                                                   temperature=0, stream=True, extra_body={"ignore_eos": True})
    finish, first = None, True
    try:
        async for chunk in stream:
            if first and chunk.choices and chunk.choices[0].delta.content:
                first = False
                counter[0] += 1
                if counter[0] == 8:
                    started.set()
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
    except openai.APIError as exc:  # the server's error event
        return "error", str(exc)
    return ("done", finish) if finish else ("truncated", "")


def test_sigterm_during_8_streams_exits_0_within_the_grace_period(server):
    async def scenario():
        aclient = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=120)
        started, counter = asyncio.Event(), [0]
        # 4 that finish well within the grace period, 4 that cannot (2000 tokens on a CPU).
        lengths = [8] * 4 + [2000] * 4
        tasks = [asyncio.ensure_future(_stream(aclient, QUESTIONS[i], n, started, counter))
                 for i, n in enumerate(lengths)]
        await asyncio.wait_for(started.wait(), 120)
        server.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        await asyncio.sleep(1.0)
        with pytest.raises(httpx.TransportError):  # it stopped accepting
            httpx.get(f"{server.base_url}/health", timeout=5)
        results = await asyncio.gather(*tasks)
        return results, sent

    results, sent = asyncio.run(scenario())
    code = server.proc.wait(SHUTDOWN_TIMEOUT_S + EXIT_MARGIN_S)
    took = time.monotonic() - sent
    assert code == 0, server.output()
    assert took <= SHUTDOWN_TIMEOUT_S + EXIT_MARGIN_S, server.output()
    http_stop = float(re.search(r"the HTTP server stopped ([0-9.]+)s after the stop signal", server.output())[1])
    assert SHUTDOWN_TIMEOUT_S - 1 <= http_stop <= SHUTDOWN_TIMEOUT_S + HTTP_STOP_MARGIN_S
    assert results[:4] == [("done", "length")] * 4
    assert [kind for kind, _ in results[4:]] == ["error"] * 4
    assert all("shut down" in message for _, message in results[4:])
