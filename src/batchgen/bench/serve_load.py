"""`batchgen bench --workload serve`: `batchgen serve` under streaming clients, beside the same prompts offline.

The random workload's prompts (token ids, so tokenizing is outside both measurements) go to a
`batchgen serve` subprocess as streaming /v1/completions requests arriving as a Poisson process at
each request rate (seeded: the same arrival times on every run), at most `max_concurrency` in flight
(vLLM's benchmark_serving semantics: a request waits for a free client slot, then is sent). The
client measures what a user sees: TTFT from sending to the first text chunk, TPOT as (last chunk -
first chunk) / (completion tokens - 1), end-to-end latency; and, from the server's /metrics before
and after, the server's own mean latency, so `server_adds_s` (client mean e2e - server mean e2e) is
what HTTP, JSON and the event stream add per request. Offline: the same prompts through the
engine's add_request/step loop in this process (what `batchgen run` drives), with the same settings.
Greedy with a fixed output length (EOS ignored), as the other workloads.
"""

from __future__ import annotations

import asyncio
import gc
import json
import random
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from batchgen.bench.engine_side import build_engine, run_engine
from batchgen.bench.workloads import BenchRequest, Workload

BOOT_TIMEOUT_S = 600
MODEL_NAME = "bench"  # the server's --served-model-name


@dataclass
class ClientResult:
    is_ok: bool
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    num_tokens: int = 0
    error: str | None = None


def poisson_arrivals(num_requests: int, rate: float, seed: int) -> list[float]:
    """Send times in seconds from the start: the first at 0, then exponential gaps of mean 1/rate."""
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(num_requests):
        times.append(now)
        now += rng.expovariate(rate)
    return times


def percentiles(values: list[float]) -> dict | None:
    if not values:
        return None
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(np.mean(values))}


async def _one_request(http: httpx.AsyncClient, request: BenchRequest, send_at: float, start: float,
                       slots: asyncio.Semaphore, model: str) -> ClientResult:
    await asyncio.sleep(max(0.0, start + send_at - time.perf_counter()))
    body = {"model": model, "prompt": request.prompt_token_ids, "max_tokens": request.output_len,
            "min_tokens": request.output_len, "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    async with slots:
        sent = time.perf_counter()
        first = last = None
        num_tokens = 0
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread())[:200]
                return ClientResult(False, error=f"HTTP {response.status_code}: {text!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return ClientResult(False, error=chunk["error"]["message"])
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    last = time.perf_counter()
                    first = first or last
                if chunk.get("usage"):
                    num_tokens = chunk["usage"]["completion_tokens"]
        end = time.perf_counter()
    if first is None:
        return ClientResult(False, error="no text came back")
    tpot = (last - first) / (num_tokens - 1) if num_tokens > 1 else None
    return ClientResult(True, first - sent, tpot, end - sent, num_tokens)


async def run_load(base_url: str, requests: list[BenchRequest], rate: float, max_concurrency: int, seed: int,
                   model: str = MODEL_NAME, api_key: str | None = None) -> tuple[list[ClientResult], float]:
    """Every request once at Poisson(rate) arrivals; (results in request order, wall seconds)."""
    arrivals = poisson_arrivals(len(requests), rate, seed)
    slots = asyncio.Semaphore(max_concurrency)
    limits = httpx.Limits(max_connections=max_concurrency + 4)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(600.0), limits=limits,
                                 headers=headers) as http:
        start = time.perf_counter()
        results = await asyncio.gather(*(_one_request(http, r, t, start, slots, model)
                                         for r, t in zip(requests, arrivals)))
        seconds = time.perf_counter() - start
    return list(results), seconds


def summarize(results: list[ClientResult], seconds: float, rate: float, server_before: dict,
              server_after: dict) -> dict:
    ok = [r for r in results if r.is_ok]
    tokens = sum(r.num_tokens for r in ok)
    num_server = server_after.get("e2e_count", 0) - server_before.get("e2e_count", 0)
    server_e2e = ((server_after.get("e2e_sum", 0) - server_before.get("e2e_sum", 0)) / num_server
                  if num_server else None)
    client_e2e = float(np.mean([r.e2e_s for r in ok])) if ok else None
    return {
        "request_rate": rate, "num_requests": len(results), "num_failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5], "seconds": seconds,
        "request_throughput": len(ok) / seconds, "output_tokens_per_s": tokens / seconds,
        "ttft_s": percentiles([r.ttft_s for r in ok]),
        "tpot_s": percentiles([r.tpot_s for r in ok if r.tpot_s is not None]),
        "e2e_s": percentiles([r.e2e_s for r in ok]),
        "server_mean_e2e_s": server_e2e,
        "server_adds_s": client_e2e - server_e2e if client_e2e is not None and server_e2e is not None else None,
    }


def server_latency_sums(base_url: str) -> dict:
    """The server's e2e histogram sum and count (its own measure: from request arrival to last token)."""
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    found = {}
    for key, metric in (("e2e_sum", "e2e_request_latency_seconds_sum"),
                        ("e2e_count", "e2e_request_latency_seconds_count")):
        match = re.search(rf"^batchgen:{metric}\{{[^}}]*\}} (\S+)$", text, re.M)
        found[key] = float(match.group(1)) if match else 0.0
    return found


class ServeProcess:
    """`batchgen serve` in a subprocess on 127.0.0.1 and a free port."""

    def __init__(self, model: str, engine_flags: list[str], log_path: Path):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "wb")
        cmd = [sys.executable, "-m", "batchgen.cli.main", "serve", model, "--host", "127.0.0.1",
               "--port", str(self.port), "--served-model-name", MODEL_NAME, "--uvicorn-log-level", "warning",
               "--max-queued-requests", "100000", *engine_flags]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"batchgen serve exited with {self.proc.returncode}: see {self.log_path}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"batchgen serve did not come up in {BOOT_TIMEOUT_S}s: see {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def serve_flags(overrides: dict, num_threads: int | None) -> list[str]:
    """The bench's engine settings (float32 on the CPU, --engine overrides) as `batchgen serve` flags."""
    settings = {"dtype": "float32", "device": "cpu", **overrides}
    if num_threads:
        settings["num_threads"] = num_threads
    flags = []
    for key, value in settings.items():
        name = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(name if value else "--no-" + name[2:])
        else:
            flags += [name, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    return flags


def run_serve_bench(opts, request_rates: list[float], max_concurrency: int, log_dir: Path, say) -> dict:
    """Offline first (in this process, then freed), then the server at each rate; the result dict.

    `opts`: BenchOptions (model, the random workload's sizes, seed, --engine overrides, threads)."""
    from batchgen.bench.harness import make_workload
    from batchgen.bench.machine import cpu_busy_fraction, machine_fingerprint

    model, overrides, num_threads, seed = opts.model, opts.engine_overrides, opts.num_threads, opts.seed
    busy_before = cpu_busy_fraction()
    say(f"offline: loading the engine ({model})")
    engine = build_engine(model, num_threads, overrides)
    workload = make_workload(opts, engine)
    run_engine(engine, Workload("warmup", workload.requests[:2]), "warmup")
    say(f"offline: {workload.num_requests} requests")
    offline = run_engine(engine, workload, "offline")
    del engine
    gc.collect()
    offline_summary = {"seconds": offline.seconds, "request_throughput": workload.num_requests / offline.seconds,
                       "output_tokens_per_s": offline.completion_tokens_per_s}
    say(f"offline: {offline.completion_tokens_per_s:.1f} output tok/s")

    log_dir.mkdir(parents=True, exist_ok=True)
    server = ServeProcess(model, serve_flags(overrides, num_threads), log_dir / "bench-serve.log")
    runs = []
    try:
        say(f"serve: starting batchgen serve (log {server.log_path})")
        server.wait_ready()
        asyncio.run(run_load(server.base_url, workload.requests[:2], 100.0, 2, seed))  # warm-up, untimed
        for rate in request_rates:
            say(f"serve: {workload.num_requests} requests at {rate:g} req/s, at most {max_concurrency} at once")
            before = server_latency_sums(server.base_url)
            results, seconds = asyncio.run(run_load(server.base_url, workload.requests, rate, max_concurrency,
                                                    seed))
            runs.append(summarize(results, seconds, rate, before, server_latency_sums(server.base_url)))
            say(f"serve: {runs[-1]['output_tokens_per_s']:.1f} output tok/s, TTFT p50 "
                f"{(runs[-1]['ttft_s'] or {}).get('p50', float('nan')):.3f}s")
    finally:
        server.stop()
    return {"model": model, "workload": {**workload.describe(), "seed": seed},
            "machine": {**machine_fingerprint(), "cpu_busy_before": busy_before},
            "offline": offline_summary, "serve": runs, "max_concurrency": max_concurrency}


def format_serve_report(result: dict) -> str:
    w, off = result["workload"], result["offline"]
    lines = [f"batchgen bench: workload serve: {w['num_requests']} requests, prompts {w['prompt_len_min']}-"
             f"{w['prompt_len_max']} tokens, output {w.get('output_len', '?')} tokens, Poisson arrivals "
             f"(seed {w.get('seed', '?')}), at most {result['max_concurrency']} streaming clients at once",
             f"  offline (same prompts, add_request/step loop): {off['output_tokens_per_s']:.1f} output tok/s, "
             f"{off['request_throughput']:.2f} req/s", "",
             f"  {'rate req/s':>10} {'req/s':>7} {'out tok/s':>10} {'TTFT p50/p90/p99 s':>22} "
             f"{'TPOT p50/p90/p99 ms':>22} {'server adds ms':>15} {'failed':>7}"]
    for run in result["serve"]:
        ttft, tpot = run["ttft_s"] or {}, run["tpot_s"] or {}

        def three(p: dict, scale: float, fmt: str) -> str:
            return "/".join(format(p[k] * scale, fmt) for k in ("p50", "p90", "p99")) if p else "-"
        adds = f"{run['server_adds_s'] * 1000:.1f}" if run["server_adds_s"] is not None else "-"
        lines.append(f"  {run['request_rate']:>10g} {run['request_throughput']:>7.2f} "
                     f"{run['output_tokens_per_s']:>10.1f} {three(ttft, 1, '.2f'):>22} "
                     f"{three(tpot, 1000, '.0f'):>22} {adds:>15} {run['num_failed']:>7}")
    return "\n".join(lines)
