"""Server metrics in Prometheus' text format, named after vLLM's (`batchgen:` in place of `vllm:`).

The engine thread records finished requests and publishes a gauge snapshot after each step; the
HTTP side only reads. Latencies are measured from when the HTTP request arrived, as a client sees
them (tokenizing and queueing included).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from batchgen.engine import RequestOutput

# vLLM's buckets for these histograms (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


@dataclass
class Histogram:
    name: str
    help: str
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.count += 1

    def render(self, labels: str) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        for bound, num in zip(self.buckets, self.counts):
            lines.append(f'{self.name}_bucket{{{labels},le="{bound}"}} {num}')
        lines += [f'{self.name}_bucket{{{labels},le="+Inf"}} {self.count}',
                  f"{self.name}_sum{{{labels}}} {self.total}", f"{self.name}_count{{{labels}}} {self.count}"]
        return lines


@dataclass
class EngineGauges:
    """What the engine thread publishes after each step."""

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 1
    num_prefix_queried_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    num_preemptions: int = 0


class Metrics:
    def __init__(self, model_name: str):
        self.labels = f'model_name="{_escape(model_name)}"'
        self.lock = threading.Lock()
        self.gauges = EngineGauges()
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_finished = {"stop": 0, "length": 0, "abort": 0, "error": 0}
        self.num_rejected = 0  # 503: over the queue bound or shutting down
        self.ttft = Histogram("batchgen:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.tpot = Histogram("batchgen:request_time_per_output_token_seconds",
                              "Per request: (last token - first token) / (completion tokens - 1).", TPOT_BUCKETS)
        self.e2e = Histogram("batchgen:e2e_request_latency_seconds", "Request latency.", E2E_BUCKETS)

    def publish(self, gauges: EngineGauges) -> None:
        with self.lock:
            self.gauges = gauges

    def count_end(self, reason: str, num_samples: int) -> None:
        """Samples that ended without completing (abort, error)."""
        with self.lock:
            self.num_finished[reason] = self.num_finished.get(reason, 0) + num_samples

    def count_rejected(self) -> None:
        with self.lock:
            self.num_rejected += 1

    def record_finished(self, out: RequestOutput, arrival_time: float) -> None:
        """A request that completed; `arrival_time` is when its HTTP request arrived (monotonic)."""
        with self.lock:
            self.num_prompt_tokens += len(out.prompt_token_ids)
            for c in out.outputs:
                num_tokens = len(c.token_ids)
                self.num_generation_tokens += num_tokens
                self.num_finished[c.finish_reason] = self.num_finished.get(c.finish_reason, 0) + 1
                if num_tokens >= 2:
                    self.tpot.observe((c.last_token_time - c.first_token_time) / (num_tokens - 1))
            if out.metrics.first_token_time is not None:
                self.ttft.observe(out.metrics.first_token_time - arrival_time)
                self.e2e.observe(out.metrics.last_token_time - arrival_time)

    def render(self) -> str:
        with self.lock:
            g, labels = self.gauges, self.labels
            hit_rate = g.num_prefix_hit_tokens / g.num_prefix_queried_tokens if g.num_prefix_queried_tokens else 0.0
            samples = [
                ("gauge", "num_requests_running", "Requests with a sequence in the running batch.",
                 g.num_requests_running),
                ("gauge", "num_requests_waiting", "Requests in the server not yet running.", g.num_requests_waiting),
                ("gauge", "kv_cache_usage_perc", "Share of KV blocks in use (1 = full).",
                 1 - g.num_free_blocks / g.num_blocks),
                ("gauge", "num_free_kv_blocks", "KV blocks free (cached ones included).", g.num_free_blocks),
                ("gauge", "num_kv_blocks", "KV blocks in the pool.", g.num_blocks),
                ("gauge", "prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / tokens looked up.",
                 hit_rate),
                ("counter", "prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
                 g.num_prefix_queried_tokens),
                ("counter", "prefix_cache_hits_total", "Prompt tokens found in the prefix cache.",
                 g.num_prefix_hit_tokens),
                ("counter", "num_preemptions_total", "Sequences preempted.", g.num_preemptions),
                ("counter", "prompt_tokens_total", "Prompt tokens of finished requests.", self.num_prompt_tokens),
                ("counter", "generation_tokens_total", "Tokens generated for finished requests.",
                 self.num_generation_tokens),
                ("counter", "num_requests_rejected_total", "Requests answered 503 (queue full or shutting down).",
                 self.num_rejected),
            ]
            lines = []
            for kind, name, text, value in samples:
                lines += [f"# HELP batchgen:{name} {text}", f"# TYPE batchgen:{name} {kind}",
                          f"batchgen:{name}{{{labels}}} {value}"]
            lines += ["# HELP batchgen:request_success_total Finished samples by finish reason.",
                      "# TYPE batchgen:request_success_total counter"]
            for reason, num in sorted(self.num_finished.items()):
                lines.append(f'batchgen:request_success_total{{{labels},finished_reason="{reason}"}} {num}')
            for histogram in (self.ttft, self.tpot, self.e2e):
                lines += histogram.render(labels)
        return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
