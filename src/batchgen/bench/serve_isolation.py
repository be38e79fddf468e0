"""How well `batchgen serve` keeps one client's request from hurting the others: two figures.

    python -m batchgen.bench.serve_isolation [--model smollm2-135m-instruct] [--big-mib 9] [--streams 100]

1. A normal chat request's latency (8 greedy tokens) with the server idle, then while a chat request
   of `--big-mib` MiB of content is being handled (sent first; the normal requests start once its
   body is uploaded and go on, one after another, until its answer arrives). With max_model_len 2048
   the big request ends as a 400 (context_length_exceeded) once it has been tokenized: what is
   measured is what its tokenization costs everyone else.
2. Disconnect to blocks back: `--streams` streaming requests (EOS ignored), each read until its first
   content chunk; then every client resets its connection at once, and /metrics is polled until no
   request runs and every KV block is free. Repeated `--rounds` times, then once more with the cut
   made while a `--big-mib` chat is being encoded. A step's time (2 s of steps with every stream
   running) is printed beside it: "within one step" means the figure stays near it.

The server runs in a subprocess (the bundled model on the CPU, float32); one JSON object is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from batchgen.bench.serve_load import MODEL_NAME, ServeProcess, serve_flags

NORMAL = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "What is the capital of France?"}],
          "max_tokens": 8, "temperature": 0}
POLL_S = 0.01


def say(text: str) -> None:
    print(f"serve_isolation: {text}", file=sys.stderr, flush=True)


def metrics(base_url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(f"{base_url}/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[re.sub(r"\{.*\}", "", name)] = float(value)
    return values


def big_chat(mib: float) -> str:
    """A chat request body with `mib` MiB of English in its one message."""
    num_chars = int(mib * 2**20)
    content = ("The quick brown fox jumps over the lazy dog. " * (num_chars // 45 + 1))[:num_chars]
    return json.dumps({**NORMAL, "messages": [{"role": "user", "content": content}]})


def is_idle(m: dict[str, float]) -> bool:
    return (m["batchgen:num_requests_running"] == 0 and m["batchgen:num_requests_waiting"] == 0
            and m["batchgen:num_free_kv_blocks"] == m["batchgen:num_kv_blocks"])


async def normal_latency(http: httpx.AsyncClient) -> float:
    start = time.perf_counter()
    response = await http.post("/v1/chat/completions", json=NORMAL)
    response.raise_for_status()
    return time.perf_counter() - start


async def latency_beside_a_big_request(base_url: str, big_mib: float, num_idle: int) -> dict:
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
        await normal_latency(http)  # warm
        idle = [await normal_latency(http) for _ in range(num_idle)]
        say(f"idle latencies {[round(x, 3) for x in idle]}")
        big_body = big_chat(big_mib)
        sent = time.perf_counter()
        big = asyncio.ensure_future(http.post("/v1/chat/completions", content=big_body,
                                              headers={"Content-Type": "application/json"}))
        await asyncio.sleep(1.0)  # its body is uploaded (loopback): it is being parsed or tokenized now
        during = []
        while not big.done():
            during.append(await normal_latency(http))
            say(f"latency beside the big request {during[-1]:.3f}s")
        big_response = await big
        big_s = time.perf_counter() - sent
        say(f"the big request answered {big_response.status_code} after {big_s:.1f}s")
    return {"idle_s": idle, "idle_median_s": statistics.median(idle), "during_s": during,
            "during_median_s": statistics.median(during) if during else None,
            "during_max_s": max(during) if during else None,
            "ratio_median": statistics.median(during) / statistics.median(idle) if during else None,
            "big_status": big_response.status_code, "big_answer_s": big_s,
            "big_code": (big_response.json().get("error") or {}).get("code")
            if big_response.headers.get("content-type", "").startswith("application/json") else None}


async def open_stream(port: int, index: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A streaming chat request on a raw socket, read until its first content chunk."""
    body = json.dumps({**NORMAL, "messages": [{"role": "user", "content": f"Count from {index} upwards."}],
                       "max_tokens": 1500, "ignore_eos": True, "stream": True}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    await writer.drain()
    while True:
        line = await reader.readline()
        if not line:
            raise RuntimeError(f"stream {index} ended before its first content")
        choices = json.loads(line[6:]).get("choices") if line.startswith(b"data: {") else None
        if choices and choices[0].get("delta", {}).get("content"):
            return reader, writer


async def step_time(reader: asyncio.StreamReader, seconds: float = 3.0) -> float | None:
    """The median gap between a running stream's chunks over `seconds`: one step each (a token per step)."""
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        line = await reader.readline()
        if line.startswith(b"data: {"):
            times.append(time.perf_counter())
    gaps = [b - a for a, b in zip(times, times[1:])]
    return statistics.median(gaps) if gaps else None


async def disconnect_to_free(base_url: str, port: int, num_streams: int, beside_big_mib: float = 0.0) -> dict:
    """`beside_big_mib`: cut the streams 1 s after a chat of that many MiB was sent (it is being encoded)."""
    streams = await asyncio.gather(*(open_stream(port, i) for i in range(num_streams)))
    busy = metrics(base_url)
    step_s = await step_time(streams[0][0])
    big = None
    if beside_big_mib:
        body = big_chat(beside_big_mib)
        http = httpx.AsyncClient(base_url=base_url, timeout=600)
        big = asyncio.ensure_future(http.post("/v1/chat/completions", content=body,
                                              headers={"Content-Type": "application/json"}))
        await asyncio.sleep(1.0)
    say(f"{num_streams} streams running (a step: {step_s:.3f}s); cutting them")
    cut = time.perf_counter()
    for _, writer in streams:
        writer.transport.abort()  # the client is gone: no FIN handshake to wait for
    loop = asyncio.get_running_loop()
    while True:
        m = await loop.run_in_executor(None, metrics, base_url)
        if is_idle(m):
            seconds = time.perf_counter() - cut
            say(f"every block back {seconds:.3f}s after the cut")
            big_s = None
            if big is not None:
                await big
                big_s = time.perf_counter() - cut
                await http.aclose()
                say(f"the big request answered {big_s:.1f}s after the cut")
            num_used = busy["batchgen:num_kv_blocks"] - busy["batchgen:num_free_kv_blocks"]
            return {"seconds": seconds, "step_s": step_s, "blocks_used_before": num_used,
                    "running_before": busy["batchgen:num_requests_running"],
                    "big_answered_after_cut_s": big_s}
        await asyncio.sleep(POLL_S)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--big-mib", type=float, default=9.0)
    parser.add_argument("--idle-requests", type=int, default=5)
    parser.add_argument("--streams", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--skip", choices=["latency", "disconnect"], default=None)
    args = parser.parse_args(argv)
    flags = serve_flags({"kv_cache_memory": "1GiB", "max_model_len": 2048, "max_num_seqs": 128},
                        args.num_threads)
    with tempfile.TemporaryDirectory() as tmp:
        server = ServeProcess(args.model, flags, Path(tmp) / "server.log")
        try:
            server.wait_ready()
            say("server ready")
            result: dict = {"model": args.model, "big_mib": args.big_mib, "streams": args.streams}
            if args.skip != "latency":
                result["latency"] = asyncio.run(latency_beside_a_big_request(server.base_url, args.big_mib,
                                                                             args.idle_requests))
            if args.skip != "disconnect":
                rounds = [asyncio.run(disconnect_to_free(server.base_url, server.port, args.streams))
                          for _ in range(args.rounds)]
                result["disconnect_to_free"] = {"rounds": rounds,
                                                "seconds": [r["seconds"] for r in rounds]}
                beside = asyncio.run(disconnect_to_free(server.base_url, server.port, args.streams,
                                                        beside_big_mib=args.big_mib))
                result["disconnect_to_free_beside_big"] = beside
        finally:
            server.stop()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
