"""Hostile and careless requests against one `batchgen serve` process: bodies over the limit (413 before
they are read), JSON nested too deep, lone surrogates, wrong types, a lower-case bearer scheme, a large
prompt beside normal ones, and cut streams; after all of them, a normal request answers and /metrics
shows nothing running and every KV block free.

Malformed bodies go over raw HTTP (httpx, or a socket where the client must stop halfway); the rest
through the real `openai` client.
"""

from __future__ import annotations

import asyncio
import json
import select
import socket
import time

import httpx
import openai
import pytest

from tests.conftest import MODEL
from tests.engine.prompts import chat
from tests.serve.server_process import ServerProcess

pytestmark = pytest.mark.server

KEY = "hostile-key"
MAX_BODY = 32 << 20  # the default --max-request-body-bytes
CHAT_URL = "/v1/chat/completions"
HEADERS = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
COMPLETIONS_URL = "/v1/completions"


def request_head(url: str) -> str:
    return f"POST {url} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"


REQUEST_HEAD = request_head(CHAT_URL)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = ServerProcess(tmp_path_factory.mktemp("hostile") / "server.log", "--api-key", KEY,
                           "--max-num-seqs", "16")
    yield server.wait_ready()
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0, timeout=120)


def post_raw(server, body: bytes | str, headers: dict | None = None) -> httpx.Response:
    return httpx.post(server.base_url + CHAT_URL, content=body, headers=headers or HEADERS, timeout=60)


def error_of(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def raw_exchange(server, head: bytes, body_parts: list[bytes], timeout: float = 60.0) -> bytes:
    """Send `head`, then the parts of the body one by one until the server answers (or they run out);
    the status line and headers of the answer."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as sock:
        sock.sendall(head)
        answer = b""
        for part in body_parts:
            if select.select([sock], [], [], 0)[0]:
                break  # the server answered (or closed): stop sending
            try:
                sock.sendall(part)
            except (BrokenPipeError, ConnectionResetError):
                break
        while b"\r\n\r\n" not in answer:
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
        return answer


def test_a_body_over_the_limit_gets_413_before_it_is_read(server):
    # A declared length over the limit: answered from the headers, none of the 64 MiB is sent.
    for url in (CHAT_URL, COMPLETIONS_URL):
        head = (request_head(url) + f"Content-Length: {2 * MAX_BODY}\r\n\r\n").encode()
        answer = raw_exchange(server, head, [b'{"messages": ['])
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]

    # Chunked, no length: refused once the bytes read pass the limit, before the body ends (it never does).
    head = (request_head(COMPLETIONS_URL) + "Transfer-Encoding: chunked\r\n\r\n").encode()
    answer = raw_exchange(server, head, [CHUNK_1MIB] * (MAX_BODY // (1 << 20) + 8))
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


CHUNK_1MIB = b"%x\r\n" % (1 << 20) + b" " * (1 << 20) + b"\r\n"


def test_a_chat_body_longer_than_the_context_could_hold_is_refused_before_it_is_read(server, client):
    """A 30 MB chat body (under the 32 MiB limit) took 21 s and 4.4 GB to be refused after tokenizing:
    no text that long fits 2,048 tokens of at most 81 bytes each, so it is a 400 from its headers."""
    start = time.monotonic()
    head = (REQUEST_HEAD + f"Content-Length: {30 << 20}\r\n\r\n").encode()
    answer = raw_exchange(server, head, [b'{"messages": [{"role": "user", "content": "'] + [b"a" * (1 << 20)] * 30)
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    # Chunked: refused once the bytes read pass what a prompt could hold (~3 MB here), long before 30 MB.
    head = (REQUEST_HEAD + "Transfer-Encoding: chunked\r\n\r\n").encode()
    answer = raw_exchange(server, head, [CHUNK_1MIB] * 30)
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    assert time.monotonic() - start < 10
    # Under the body bound but still more text than fits: refused after parsing, before tokenizing.
    for url, body in ((COMPLETIONS_URL, {"prompt": "word " * 400_000}), (CHAT_URL, {"messages": chat("word " * 400_000)})):
        error = error_of(httpx.post(server.base_url + url, headers=HEADERS, timeout=60, json={**body, "max_tokens": 1}))
        assert error["code"] == "context_length_exceeded" and "bytes of text" in error["message"]
    reply = client.chat.completions.create(model=MODEL, messages=chat("Hi"), max_tokens=2)
    assert reply.usage.completion_tokens == 2


def test_json_nested_too_deep_is_a_400_naming_the_body_or_the_field(server):
    messages = '{"model": "m", "messages": ' + "[" * 100_000 + "]" * 100_000 + "}"
    assert error_of(post_raw(server, messages))["param"] == "body"
    stop = json.dumps({"messages": chat("Hi"), "max_tokens": 2})[:-1] + ', "stop": ' + "[" * 5000 + "]" * 5000
    stop += "}"
    assert error_of(post_raw(server, stop))["param"] == "body"
    shallow = json.dumps({"messages": chat("Hi"), "max_tokens": 2, "stop": json.loads("[" * 40 + "]" * 40)})
    error = error_of(post_raw(server, shallow))
    assert error["param"].startswith("stop") and "deeper than" in error["message"]


def test_a_lone_surrogate_is_a_400_naming_the_string(server):
    messages = [{"role": "system", "content": "ok"}, {"role": "user", "content": "a\ud800b"}]
    body = json.dumps({"messages": messages, "max_tokens": 2})
    assert "\\ud800" in body
    error = error_of(post_raw(server, body))
    assert error["param"] == "messages[1].content" and "surrogate" in error["message"]
    completion = json.dumps({"prompt": ["fine", "x\udfffy"], "max_tokens": 2})
    response = httpx.post(server.base_url + "/v1/completions", content=completion, headers=HEADERS,
                          timeout=60)
    assert error_of(response)["param"] == "prompt[1]"
    key = json.dumps({"messages": chat("Hi"), "\ud83d": 1})
    assert error_of(post_raw(server, key))["param"] == "body"


@pytest.mark.parametrize("field, value", [
    ("max_tokens", "4"), ("max_tokens", True), ("max_tokens", 4.5), ("n", "1"), ("seed", False),
    ("temperature", "0.5"), ("temperature", True), ("top_p", "1"), ("logprobs", 1), ("logprobs", "true"),
    ("stream", "false"), ("ignore_eos", 0), ("stop_token_ids", [True]), ("top_k", 5.5),
])
def test_a_value_of_the_wrong_type_is_a_400_naming_the_field(client, field, value):
    fields = {"max_tokens": 2, field: value}
    # extra_body: sent as given, whatever the client's own types say
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=chat("Hi"), extra_body=fields)
    assert info.value.body["param"] == field, info.value.body


def test_integers_where_numbers_go_and_integral_numbers_where_integers_go_are_fine(client):
    reply = client.chat.completions.create(model=MODEL, messages=chat("Hi"), max_tokens=3.0, temperature=0,
                                           top_p=1, n=1.0, extra_body={"top_k": 40.0})
    assert reply.usage.completion_tokens == 3


def test_the_bearer_scheme_is_case_insensitive(server):
    body = json.dumps({"messages": chat("Hi"), "max_tokens": 1})
    for scheme in ("Bearer", "bearer", "BEARER"):
        headers = {**HEADERS, "Authorization": f"{scheme} {KEY}"}
        assert post_raw(server, body, headers).status_code == 200, scheme
    for header in (f"Basic {KEY}", f"Bearer {KEY}x", f"Bearer{KEY}", KEY, ""):
        assert post_raw(server, body, {**HEADERS, "Authorization": header}).status_code == 401, header


def test_a_large_prompt_is_refused_without_holding_up_normal_requests(server, client):
    """3 MB of chat took seconds of tokenizing before its 400; now its byte length alone refuses it, before
    the template or the tokenizer, while a normal request is answered as usual. A 150 KB prompt (within
    the byte bound, over 2,048 tokens) is tokenized on the encoder's thread and refused with its count."""
    content = ("The quick brown fox jumps over the lazy dog. " * 70_000)[:3_000_000]
    start = time.monotonic()
    error = error_of(post_raw(server, json.dumps({"messages": chat(content), "max_tokens": 2})))
    assert error["code"] == "context_length_exceeded" and "bytes of text" in error["message"]
    assert time.monotonic() - start < 5
    error = error_of(post_raw(server, json.dumps({"messages": chat(content[:150_000]), "max_tokens": 2})))
    assert error["code"] == "context_length_exceeded" and "the messages has" in error["message"], error
    reply = client.chat.completions.create(model=MODEL, messages=chat("Hi"), max_tokens=2, temperature=0)
    assert reply.usage.completion_tokens == 2


def _ref_chain(num_links: int) -> dict:
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["x"]}
            for i in range(num_links)}
    defs[f"d{num_links}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


POISON_BODIES = {  # each crashed the server (the $ref chains) or failed every request in its step
    "ref-chain-1000": {"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": _ref_chain(1_000)}}},
    "ref-chain-5000": {"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": _ref_chain(5_000)}}},
    "regex-bomb": {"structured_outputs": {"regex": "a{1000}{1000}"}},
    "choice-100000": {"structured_outputs": {"choice": [f"c{i}" for i in range(100_000)]}},
}


def test_poison_constraints_are_400s_and_concurrent_requests_are_unchanged(server, client):
    def normal(i: int) -> list[int]:
        reply = client.chat.completions.create(model=MODEL, messages=chat(f"Name a colour, {i}."), max_tokens=8,
                                               temperature=0.8, seed=i, logprobs=True)
        return [t.token for t in reply.choices[0].logprobs.content]

    quiet = [normal(i) for i in range(4)]

    async def together() -> tuple[list, dict]:
        async with httpx.AsyncClient(base_url=server.base_url, headers=HEADERS, timeout=120) as http:
            async def poison(body: dict) -> httpx.Response:
                return await http.post(CHAT_URL, json={"messages": chat("Hi"), "max_tokens": 4, **body})
            normals = [asyncio.to_thread(normal, i) for i in range(4)]
            results = await asyncio.gather(*normals, *(poison(b) for b in POISON_BODIES.values()))
        return results[:4], dict(zip(POISON_BODIES, results[4:]))

    tokens, poisoned = asyncio.run(together())
    assert tokens == quiet  # the same tokens as alone
    for name, response in poisoned.items():
        error = error_of(response)
        assert error["param"] in ("response_format.json_schema.schema", "structured_outputs.regex",
                                  "structured_outputs.choice"), (name, error)
        assert "backtrace" not in error["message"] and "<unknown>" not in error["message"]
    assert server.proc.poll() is None  # alive


def test_a_slow_schema_compiles_off_the_engine_thread(server, client):
    """A 4,000-property schema takes seconds to compile; a normal request sent meanwhile is answered
    first (the compile runs on a worker thread, not the engine thread everyone's steps run on)."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(4_000)}}
    slow_body = {"messages": chat("Hi"), "max_tokens": 2,
                 "response_format": {"type": "json_schema", "json_schema": {"name": "wide", "schema": schema}}}

    async def race() -> list[str]:
        order = []
        async with httpx.AsyncClient(base_url=server.base_url, headers=HEADERS, timeout=120) as http:
            async def slow():
                response = await http.post(CHAT_URL, json=slow_body)
                order.append("schema")
                assert response.status_code in (200, 400), response.text  # 400: past the compile deadline

            async def normal():
                await asyncio.sleep(0.3)  # the schema is compiling by now
                reply = await asyncio.to_thread(client.chat.completions.create, model=MODEL,
                                                messages=chat("Hi"), max_tokens=2, temperature=0)
                order.append(f"normal {reply.usage.completion_tokens}")

            await asyncio.gather(slow(), normal())
        return order

    assert asyncio.run(race()) == ["normal 2", "schema"]


def test_an_echo_with_logprobs_past_the_cap_is_a_400(server):
    prompt = "one two three four " * 400  # ~1,600 tokens x 21 entries: past the 32,768 cap
    response = httpx.post(server.base_url + COMPLETIONS_URL, headers=HEADERS, timeout=60,
                          json={"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 20})
    error = error_of(response)
    assert error["param"] == "logprobs" and "32,768" in error["message"], error
    small = httpx.post(server.base_url + COMPLETIONS_URL, headers=HEADERS, timeout=60,
                       json={"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1})
    assert small.status_code == 200 and len(small.json()["choices"][0]["logprobs"]["tokens"]) > 1000


def test_sequences_are_admitted_by_count_and_a_cut_flood_frees_the_server_at_once(server, client):
    """1,000 prompts x n 1,024 wedged the server for 17 minutes. Now: a request larger than the sequence
    bound alone is a 400; one that would pass it beside others a 429 with Retry-After; and after a
    client holding 16,384 sequences goes away, a normal request answers within 2 s."""
    flood = {"prompt": ["Hi"] * 1_000, "n": 1_024, "max_tokens": 16}
    error = error_of(httpx.post(server.base_url + COMPLETIONS_URL, headers=HEADERS, json=flood, timeout=60))
    assert error["code"] == "too_many_sequences" and "1,024,000" in error["message"]

    async def cut_flood() -> tuple[httpx.Response, float]:
        async with httpx.AsyncClient(base_url=server.base_url, headers=HEADERS, timeout=120) as http:
            async def hold():  # 16 x 1,024 sequences: the whole bound; the client gives up after 4 s
                with pytest.raises(httpx.ReadTimeout):
                    await http.post(COMPLETIONS_URL, json={**flood, "prompt": ["Hi"] * 16}, timeout=4)
            holder = asyncio.ensure_future(hold())
            while not server.metrics()["batchgen:num_requests_waiting"]:  # the flood is in
                await asyncio.sleep(0.1)
            refused = await http.post(COMPLETIONS_URL, json={"prompt": "Hi", "max_tokens": 2})
            await holder
        start = time.monotonic()
        await asyncio.to_thread(client.chat.completions.create, model=MODEL, messages=chat("Hi"), max_tokens=4)
        return refused, time.monotonic() - start

    refused, latency = asyncio.run(cut_flood())
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1", refused.text
    assert refused.json()["error"]["code"] == "too_many_sequences"
    assert latency < 2.0, latency
    deadline = time.monotonic() + 30
    while not _idle(server.metrics()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _idle(server.metrics())


def _idle(metrics: dict) -> bool:
    return (metrics["batchgen:num_requests_running"] == 0 and metrics["batchgen:num_requests_waiting"] == 0
            and metrics["batchgen:num_free_kv_blocks"] == metrics["batchgen:num_kv_blocks"])


async def _open_stream(server, index: int):
    """A streaming chat on a raw socket, read until its first content chunk (so it runs in the engine)."""
    body = json.dumps({"messages": chat(f"Count from {index} upwards."), "max_tokens": 1000,
                       "ignore_eos": True, "stream": True, "temperature": 0}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(f"POST {CHAT_URL} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    while True:
        line = await reader.readline()
        assert line, f"stream {index} ended before its first content"
        choices = json.loads(line[6:])["choices"] if line.startswith(b"data: {") else None
        if choices and choices[0]["delta"].get("content"):
            return writer


def test_cut_streams_free_their_blocks_at_once(server):
    """16 running streams cut by their clients: every block is back within 2 s. (A 3 MB prompt being
    encoded used to hold the aborts up; such a prompt is now refused from its size before any encoding,
    test_a_large_prompt_is_refused_without_holding_up_normal_requests.)"""
    async def cut() -> tuple[float, dict]:
        writers = await asyncio.gather(*(_open_stream(server, i) for i in range(16)))
        busy = await asyncio.to_thread(server.metrics)
        start = time.monotonic()
        for writer in writers:
            writer.transport.abort()  # the clients are gone
        while not _idle(await asyncio.to_thread(server.metrics)):
            await asyncio.sleep(0.02)
        return time.monotonic() - start, busy

    freed, busy = asyncio.run(cut())
    assert busy["batchgen:num_requests_running"] == 16
    assert busy["batchgen:num_free_kv_blocks"] < busy["batchgen:num_kv_blocks"]
    assert freed < 2.0, freed


def test_after_everything_a_normal_request_answers_and_nothing_is_held(server, client):
    reply = client.chat.completions.create(model=MODEL, messages=chat("Hi"), max_tokens=3, temperature=0)
    assert reply.usage.completion_tokens == 3 and reply.choices[0].message.content
    deadline = time.monotonic() + 30
    while not _idle(metrics := server.metrics()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metrics["batchgen:num_requests_running"] == 0 and metrics["batchgen:num_requests_waiting"] == 0
    assert metrics["batchgen:num_free_kv_blocks"] == metrics["batchgen:num_kv_blocks"] > 0
    assert server.proc.poll() is None and "Traceback" not in server.output()
