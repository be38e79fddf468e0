"""Weight-only integer matmuls on the CPU against oneDNN float32: seconds per call and GFLOP/s.

    python bench/int_matmul.py [--shapes 3072x576,576x1536,4096x4096] [--rows 1,16,64,2048]

For each weight shape (N x K) and row count M, times oneDNN float32 with a prepacked weight (the
engine's default linear) and every CPU kernel of batchgen.engine.quant.int_matmul_cpu that can hold
an int8 per-channel weight and an int4 group-128 weight. Prints one table row per (shape, M).
"""

from __future__ import annotations

import argparse
import time

import torch

from batchgen.engine.models.cpu_linear import PackedLinear
from batchgen.engine.quant.int_formats import quantize_int4_groups, quantize_int8_per_channel
from batchgen.engine.quant.int_matmul_cpu import CPU_KERNELS


def seconds_per_call(fn, x: torch.Tensor, min_seconds: float = 0.3, max_calls: int = 50) -> float:
    """The fastest of several calls: on a shared machine other jobs only ever add time."""
    fn(x)  # warm-up (first-call allocations, oneDNN primitive creation)
    times = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < min_seconds and len(times) < max_calls):
        t0 = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="3072x576,576x1536,4096x4096")
    parser.add_argument("--rows", default="1,16,64,2048")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms per call (GFLOP/s)")
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        linear = torch.nn.Linear(k, n, bias=False)
        candidates = {"fp32 oneDNN": PackedLinear(linear)}
        for label, weight in (("int8", quantize_int8_per_channel(linear.weight)),
                              ("int4 g128", quantize_int4_groups(linear.weight))):
            for kernel in CPU_KERNELS.values():
                if kernel.can_run(weight):
                    candidates[f"{label} {kernel.name}"] = kernel(weight)
        with torch.no_grad():
            for m in (int(v) for v in args.rows.split(",")):
                x = torch.randn(m, k)
                cells = []
                for name, fn in candidates.items():
                    s = seconds_per_call(fn, x)
                    cells.append(f"{name} {s * 1e3:.3f} ({2 * m * n * k / s / 1e9:.1f})")
                print(f"N={n} K={k} M={m}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
