"""The GPU check, one command: python -m batchgen.bench.gpu_check [--out gpu_check.json] [--model PATH]

Needs torch, triton and transformers only (runs after `pip install --no-deps -e .`: no pydantic,
polars or gguf). The JSON file is rewritten after every part and every speed configuration, so a run
cut short keeps what it measured; a table is printed at the end. Each part and each configuration
that fails is recorded with its error and traceback, and the next one still runs; every engine is
gone (with its KV pool) before the next sizes its own.

1. Correctness: a small Llama-shaped model with seeded random weights (or `--model PATH`, an HF
   folder) through the engine (attention_backend auto: the Triton kernels on CUDA) against HF
   transformers' own LlamaForCausalLM with the same weights (the torch reference): float32 greedy
   tokens must be identical; bfloat16 agreement is reported. FP8 matmul errors at the speed
   model's layer shapes ride along.
2. Kernels (bench/gpu_kernels.py): decode paged attention alone at the 8B shape (S = 256 at 4k
   context, S = 1 at 32k), split-KV off and on, in GB/s against the device's bandwidth, whether the
   two modes gave the same bits, and each tile candidate's rate (kernels/triton_tuning.py); one
   sampler step (N = 256, V = 128256) with top-k 50 + top-p 0.9 and top-p alone against greedy.
3. Speed: a Llama-3-8B-shaped model with seeded random weights (no download), 7 configurations:
   bf16 decode at 1, 64 and 256 sequences; CUDA graphs off at 64; FP8 KV at 256; a mixed
   prefill+decode workload; FP8 weights at 256. Completion tokens/s over the whole run and over
   decode-only steps, the decode steps' fraction of the HBM bandwidth roofline ((weights + KV bytes
   read) per step / 4.8 TB/s, H200), the KV plan (GpuMemoryPlan.describe: what the CUDA graphs
   were given) and the graphs' capture time and measured memory.
4. Peer: HF transformers `generate` in bfloat16 on the same shape at batch 64.
5. `--tensor-parallel-size N` (N GPUs): the correctness model and the speed model saved as HF
   folders (seeded random weights, a word-level tokenizer), each loaded at tp=1 and at tp=N (every
   rank reading its shard, NCCL between the GPUs, a decode graph per rank): float32 greedy tokens
   identical to tp=1, bfloat16 agreement reported; bf16 decode at 64 sequences at tp=1 and tp=N.

Time on one H200 (estimates: no GPU has run this yet), bounded by --config-time-limit per speed
configuration's workload and --time-budget for the whole run (speed configurations and the peer
past it are skipped and say so):

    part                                                     estimate
    imports, CUDA context                                        10 s
    correctness: 2 small engines + HF generate, Triton JIT       40 s
    fp8 matmul errors (7 shapes)                                  5 s
    kernels: 4 attention launches + 6 tile candidates (JIT
      ~3 s each), 3 sampler settings                             40 s
    speed: 8B init 5 s, FP8 quantization 10 s; per engine
      a profiling step, graph profiling, capture of at most
      20 sizes (1, 2, 4, 8, 16, 32, ... 256) ~10 s, then the
      workload (x1 ~5 s, x64 ~5 s, x256 ~15 s, graphs off
      ~10 s, FP8 KV ~15 s, mixed ~30 s, FP8 weights ~15 s)      ~190 s
    peer: HF generate x64, 512 + 128 tokens                     20 s
    total                                                      ~305 s (budget 330 s, < 6 min)

`--tiny` runs the same flow at toy sizes on any device (the test suite runs it on the CPU).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import traceback
from pathlib import Path

import torch

from batchgen.bench.gpu_check.correctness import check_correctness, check_fp8_matmuls
from batchgen.bench.gpu_check.models import free_device_memory, llama3_8b_config, tiny_config
from batchgen.bench.gpu_check.speed import check_kernels, run_peer, run_speed
from batchgen.bench.gpu_check.table import format_table
from batchgen.bench.gpu_check.tensor_parallel import check_tensor_parallel


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    result: dict = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device),
                    "tiny": args.tiny, "num_layers": args.layers}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
        result["capability"] = list(torch.cuda.get_device_capability(device))
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        result["triton"] = None
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))

    def record(rows: list | None = None) -> None:
        if rows is not None:
            result["speed"] = rows
            say(json.dumps(rows[-1]))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2))

    args.started = args.clock()
    record()
    speed_cfg = tiny_config() if args.tiny else llama3_8b_config(args.layers)
    model_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    result["part_seconds"] = {}
    parts = [
        ("correctness", lambda: check_correctness(args, device)),
        ("fp8_matmuls", lambda: check_fp8_matmuls(speed_cfg, device, model_dtype)),
        ("kernels", lambda: check_kernels(args, device, speed_cfg, model_dtype)),
        ("speed", lambda: run_speed(args, device, record)),
    ]
    if args.peer:
        parts.append(("peer", lambda: run_peer(args, device, clock=args.clock)))
    if args.tensor_parallel_size > 1:
        parts.append(("tensor_parallel", lambda: check_tensor_parallel(args, device, record)))
    for name, part in parts:
        started = args.clock()
        if name in ("peer", "tensor_parallel") and started - args.started > args.time_budget:
            result[name] = {"skipped": f"past the run's time budget of {args.time_budget:.0f} s"}
            continue
        try:
            result[name] = part()
        except Exception as exc:  # noqa: BLE001 - recorded; the next part still runs
            result[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=-4)}
        free_device_memory()
        result["part_seconds"][name] = args.clock() - started
        if name != "speed":
            say(json.dumps({name: result[name]})[:2000])
        record()
    correctness, matmuls = result["correctness"], result["fp8_matmuls"]
    parallel = result.get("tensor_parallel", {})
    result["ok"] = (isinstance(correctness, dict) and bool(correctness.get("ok"))
                    and isinstance(matmuls, list) and all(r["ok"] for r in matmuls)
                    and isinstance(parallel, dict) and parallel.get("ok", True) is True)
    record()
    say(format_table(result))
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    # The package's __main__.py runs it: without prog, usage would name that file.
    parser = argparse.ArgumentParser(prog="python -m batchgen.bench.gpu_check",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="toy sizes (runs anywhere, for the test suite)")
    parser.add_argument("--model", default=None, help="an HF folder for the correctness check (default: random)")
    parser.add_argument("--layers", type=int, default=32, help="decoder layers of the Llama-3-8B-shaped model")
    parser.add_argument("--device", default=None)
    parser.add_argument("--attention-backend", default="auto", help="engine.attention_backend (auto: triton on CUDA)")
    parser.add_argument("--max-configs", type=int, default=8, help="run only the first N speed configurations")
    parser.add_argument("--config-time-limit", type=float, default=40.0,
                        help="seconds a speed configuration may run its workload before it is cut short")
    parser.add_argument("--time-budget", type=float, default=330.0,
                        help="seconds after which no further speed configuration (nor the peer) starts")
    parser.add_argument("--no-peer", dest="peer", action="store_false", help="skip HF generate")
    parser.add_argument("--out", default="gpu_check.json", help="the JSON file, rewritten after each configuration")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="N > 1: also run the model over N GPUs (NCCL) against one (section 4)")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    args.clock = time.perf_counter
    args.started = args.clock()
    return args


def main(argv: list[str] | None = None) -> int:
    return 0 if run(parse_args(argv))["ok"] else 1
