"""Tensor parallelism on this machine's CPU (gloo): what each rank holds and what the split costs.

    python -m batchgen.bench.tensor_parallel [--out tp.json] [--parts memory,speed,vocab]

1. memory: the bundled model at tp=1 and tp=2, float32 and int8 (round to nearest), each engine in a
   fresh process: per rank, its weights' bytes (tensor storage) and its process's peak resident
   memory once loaded (VmHWM: the GGUF pages it read, the dequantized tensors, torch itself).
2. speed: 16 prompts x 32 greedy tokens, and 1 prompt x 64, at tp=1 (all cores, then one rank's
   share) and tp=2 (the cores split between the ranks): completion tokens/s and milliseconds per step.
3. vocab: the embedding and lm_head vocabulary-parallel (what the engine runs) against replicated on
   every rank (rank 0 alone computing the logits), at tp=2 on the model itself in two processes:
   each rank's weights and the median decode step at batch 1 and 16 (after a 32-token prefill), the
   two layouts' steps alternated.

Every figure is this machine's at the time it ran; on a shared 2-core machine they are contended.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

MODEL = "smollm2-135m-instruct"
ENGINE = {"dtype": "float32", "device": "cpu", "kv_cache_memory": "256MiB", "max_model_len": 512}


def _run_child(code: str) -> dict:
    """`code` (which prints one JSON line last) in a fresh interpreter. OpenMP's threads sleep between
    parallel regions (as in the test suite): on a shared machine spinning ones wait on descheduled peers."""
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800, check=False,
                          env=env)
    if done.returncode:
        raise RuntimeError(f"child failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


_MEMORY_CHILD = """
import json
from batchgen.engine import LLM
from batchgen.engine.parallel.worker import peak_resident_bytes
if __name__ == "__main__":
    llm = LLM({model!r}, tensor_parallel_size={tp}, **{settings!r})
    report = llm.engine.stats["tensor_parallel"]
    if report is None:
        report = {{"ranks": [{{"rank": 0, "weight_bytes": llm.engine.weight_bytes,
                              "max_rss_bytes": peak_resident_bytes()}}]}}
    llm.engine.shutdown()
    print(json.dumps([{{k: r[k] for k in ("rank", "weight_bytes", "max_rss_bytes")}} for r in report["ranks"]]))
"""


def measure_memory() -> list[dict]:
    rows = []
    for quantization in ("none", "int8"):
        for tp in (1, 2):
            settings = dict(ENGINE, quantization=quantization, int_calibration="none")
            ranks = _run_child(_MEMORY_CHILD.format(model=MODEL, tp=tp, settings=settings))
            rows.append({"quantization": quantization, "tensor_parallel_size": tp, "ranks": ranks})
            print(json.dumps(rows[-1]), flush=True)
    return rows


_SPEED_CHILD = """
import json, time
from batchgen.engine import LLM, SamplingParams
from batchgen.bench.quality_prompts import QUALITY_PROMPTS
if __name__ == "__main__":
    llm = LLM({model!r}, tensor_parallel_size={tp}, num_threads={threads}, **{settings!r})
    rows = []
    for num_prompts, num_tokens in ((16, 32), (1, 64)):
        params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
        llm.generate(QUALITY_PROMPTS[:2], SamplingParams(temperature=0, max_tokens=2))  # warm
        steps = llm.engine.stats["num_steps"]
        start = time.perf_counter()
        llm.generate(QUALITY_PROMPTS[:num_prompts], params)
        seconds = time.perf_counter() - start
        steps = llm.engine.stats["num_steps"] - steps
        rows.append({{"num_prompts": num_prompts, "num_tokens": num_tokens, "seconds": seconds, "steps": steps,
                     "completion_tokens_per_s": num_prompts * num_tokens / seconds,
                     "ms_per_step": 1000 * seconds / steps}})
    llm.engine.shutdown()
    print(json.dumps(rows))
"""


def measure_speed() -> list[dict]:
    """tp=1 on every core and on one (a rank's share), tp=2 with the cores split between the ranks."""
    cores = os.cpu_count() or 2
    rows = []
    for tp, threads in ((1, cores), (1, max(1, cores // 2)), (2, max(1, cores // 2))):
        result = _run_child(_SPEED_CHILD.format(model=MODEL, tp=tp, threads=threads, settings=ENGINE))
        for row in result:
            rows.append({"tensor_parallel_size": tp, "threads_per_rank": threads, **row})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _vocab_rank(rank: int, port: int, results) -> None:
    """One rank of the vocab measurement (a spawned process): both layouts loaded side by side, their
    decode steps alternated (A, B, then B, A, ...) so a load that drifts meanwhile weighs on both."""
    import torch
    import torch.distributed as dist

    from batchgen.engine.config import EngineConfig
    from batchgen.engine.loader.model_loader import load_model, read_model_config
    from batchgen.engine.loader.source import resolve_model
    from batchgen.engine.parallel import TensorParallel, TensorParallelGroup, TensorParallelLayout
    from batchgen.engine.quant.calibrate.sequence_runner import SequenceRunner

    torch.set_num_threads(1)
    config = EngineConfig(model=MODEL, **ENGINE)
    cfg = read_model_config(resolve_model(MODEL))
    if rank == 0:
        group = TensorParallelGroup(dist.TCPStore("127.0.0.1", port, 2, True, wait_for_workers=False), 0, 2,
                                    torch.device("cpu"))
    else:
        group = TensorParallelGroup.connect(port, rank, 2, torch.device("cpu"))
    names = {True: "vocab_parallel", False: "replicated"}
    models, figures = {}, {}
    for is_vocab_parallel, name in names.items():
        loaded = load_model(config, TensorParallel(TensorParallelLayout.plan(cfg, rank, 2, is_vocab_parallel), group))
        models[name] = loaded.model
        figures[name] = {"weight_bytes": loaded.weight_bytes}
    for batch in (1, 16):
        runners = {name: SequenceRunner(model, batch, 256) for name, model in models.items()}
        prompts = [[(7 * i + j) % 1000 + 10 for j in range(32)] for i in range(batch)]
        times: dict[str, list[float]] = {name: [] for name in runners}
        for runner in runners.values():
            runner.forward(prompts, [0] * batch)
        for step in range(48):
            order = list(runners) if step % 2 == 0 else list(reversed(runners))
            for name in order:
                start = time.perf_counter()
                runners[name].forward([[100 + step]] * batch, [32 + step] * batch)
                times[name].append(time.perf_counter() - start)
        for name, values in times.items():
            figures[name][f"decode_ms_batch_{batch}"] = 1000 * sorted(values)[len(values) // 2]  # median
    results.put((rank, figures))


def measure_vocab() -> dict:
    import multiprocessing

    import torch.distributed as dist

    probe = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)  # a free port, given back
    port = probe.port
    del probe
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=_vocab_rank, args=(rank, port, results)) for rank in (0, 1)]
    for p in processes:
        p.start()
    figures = dict(results.get() for _ in processes)
    for p in processes:
        p.join()
    print(json.dumps(figures), flush=True)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="memory,speed,vocab")
    parser.add_argument("--out", default="tensor_parallel.json")
    args = parser.parse_args(argv)
    result: dict = {"cpu_count": os.cpu_count()}
    parts = args.parts.split(",")
    if "memory" in parts:
        result["memory"] = measure_memory()
    if "speed" in parts:
        result["speed"] = measure_speed()
    if "vocab" in parts:
        result["vocab"] = measure_vocab()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
