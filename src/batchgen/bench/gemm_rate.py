"""Measure the machine's float32 GEMM rate at the model's own linear-layer shapes, in this process.

The bench divides the workload's linear FLOPs by this rate to get its roofline, so the rate is
measured in the same run, with the same thread count, as the engine and the peer.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from batchgen.bench.roofline import LinearShape, layer_linear_shapes, lm_head_shape
from batchgen.engine.models.config import ModelConfig
from batchgen.engine.models.cpu_linear import PackedLinear, can_pack

PREFILL_NUM_TOKENS = 2048  # "a few thousand" rows: a typical large mixed step
DECODE_NUM_TOKENS = 64  # one decode step of a full batch


@dataclass(frozen=True)
class ShapeRate:
    name: str
    num_tokens: int
    in_features: int
    out_features: int
    seconds: float  # median of the timed repeats
    count: int = 1  # LinearShape.count: an MoE layer's expert shapes weigh top-k times in the layer rate

    @property
    def num_flops(self) -> int:
        return 2 * self.num_tokens * self.in_features * self.out_features

    @property
    def gflops_per_s(self) -> float:
        return self.num_flops / self.seconds / 1e9

    def as_dict(self) -> dict:
        shape = {"name": self.name, "num_tokens": self.num_tokens, "in_features": self.in_features,
                 "out_features": self.out_features, "seconds": self.seconds, "gflops_per_s": self.gflops_per_s}
        return shape if self.count == 1 else {**shape, "count": self.count}


@dataclass(frozen=True)
class GemmRate:
    """Rates at one row count: `layer` is one decoder layer's linears run back to back (qkv, o,
    gate_up, down), the figure the roofline divides by; `lm_head` is reported beside it."""

    num_tokens: int
    layer_flops_per_s: float
    shapes: list[ShapeRate]

    def as_dict(self) -> dict:
        return {"num_tokens": self.num_tokens, "gflops_per_s": self.layer_flops_per_s / 1e9,
                "shapes": [s.as_dict() for s in self.shapes]}


def _time_linear(shape: LinearShape, num_tokens: int, min_seconds: float, min_repeats: int,
                 dtype: torch.dtype) -> float:
    """Median seconds of one (num_tokens, in) x (out, in)^T product on the fastest float32 path the
    machine offers: torch's default mm (MKL) and, where the engine uses it, oneDNN with a prepacked
    weight. The roofline must use the best rate, not the one the peer happens to get."""
    x = torch.randn(num_tokens, shape.in_features, dtype=dtype)
    linear = torch.nn.Linear(shape.in_features, shape.out_features, bias=False, dtype=dtype)
    out = torch.empty(num_tokens, shape.out_features, dtype=dtype)
    candidates = [lambda: torch.mm(x, linear.weight.t(), out=out)]
    if can_pack(torch.device("cpu"), dtype):
        packed = PackedLinear(linear)
        candidates.append(lambda: packed(x))
    return min(_median_seconds(run, min_seconds, min_repeats) for run in candidates)


def _median_seconds(run, min_seconds: float, min_repeats: int) -> float:
    with torch.inference_mode():
        for _ in range(2):  # warm the thread pool and the caches
            run()
        times: list[float] = []
        start = time.perf_counter()
        while len(times) < min_repeats or time.perf_counter() - start < min_seconds:
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_gemm_rate(cfg: ModelConfig, num_tokens: int, min_seconds: float = 0.3, min_repeats: int = 3,
                      include_lm_head: bool = True, dtype: torch.dtype = torch.float32) -> GemmRate:
    """Time each linear of the model at `num_tokens` rows; the layer rate is their FLOPs / their time,
    each shape weighed by how often a token runs it (an MoE layer: the experts' shapes top-k times)."""
    layer = [ShapeRate(s.name, num_tokens, s.in_features, s.out_features,
                       _time_linear(s, num_tokens, min_seconds, min_repeats, dtype), s.count)
             for s in layer_linear_shapes(cfg)]
    layer_rate = sum(s.count * s.num_flops for s in layer) / sum(s.count * s.seconds for s in layer)
    shapes = list(layer)
    if include_lm_head:
        head = lm_head_shape(cfg)
        shapes.append(ShapeRate(head.name, num_tokens, head.in_features, head.out_features,
                                _time_linear(head, num_tokens, min_seconds, min_repeats, dtype)))
    return GemmRate(num_tokens, layer_rate, shapes)
