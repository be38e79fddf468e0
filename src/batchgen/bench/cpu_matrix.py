"""The CPU comparison in one command: batchgen against vLLM's CPU build in float32 and bfloat16 on the
random and chat workloads, rounds interleaved (every configuration once per round, so a busy spell
hits them alike), then the engine's bfloat16 against its float32 by part (bench/step_breakdown.py).
Each run is its own `batchgen bench` process writing its JSON; the summary takes medians over rounds.

    python -m batchgen.bench.cpu_matrix --rounds 3 --out benchmark-results/cpu-matrix
    python -m batchgen.bench.cpu_matrix --rounds 3 --threads 2 --out ...   # both engines pinned to 2 threads
    python -m batchgen.bench.cpu_matrix --summarize benchmark-results/cpu-matrix   # the table again

Threads: by default neither engine is pinned, so each runs as its public `LLM(...)` does for a user:
batchgen on torch's default (one thread per physical core), vLLM with its own binding
(VLLM_CPU_OMP_THREADS_BIND=auto: the physical cores of the first NUMA node, one kept for its
scheduler process). `--threads N` pins both to N (torch.set_num_threads for batchgen, cores 0..N-1
for vLLM): a like-for-like thread count, which on a machine with more than N cores is not what a user
of either API gets (an earlier matrix pinned 2 threads by default and so read batchgen at half the
speed its public API gave on a larger machine).

Needs the vLLM environment (`make vllm-peer`). On a quiet machine: the figures are what the docs'
benchmarks page records (docs/benchmarks/index.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

WORKLOADS = ("random", "chat")
DTYPES = ("float32", "bfloat16")


def bench_command(workload: str, dtype: str, target: Path, peer: str = "vllm", num_threads: int | None = None,
                  num_requests: int | None = None, engine_settings: tuple[str, ...] = ()) -> list[str]:
    """One `batchgen bench` run of the matrix (the CLI module: the bench package has no __main__)."""
    command = [sys.executable, "-m", "batchgen.cli.main", "bench", "--workload", workload, "--dtype", dtype,
               "--peer", peer, "--output", str(target)]
    if num_threads is not None:
        command += ["--threads", str(num_threads)]
    if num_requests is not None:
        command += ["--num-requests", str(num_requests)]
    for setting in engine_settings:  # KEY=VALUE, e.g. kv_cache_memory=512MiB (vLLM's KV space follows it)
        command += ["--engine", setting]
    return command


def run_matrix(out: Path, num_rounds: int, num_threads: int | None, peer: str = "vllm",
               workloads: tuple[str, ...] = WORKLOADS, num_requests: int | None = None,
               is_breakdown: bool = True, engine_settings: tuple[str, ...] = ()) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for round_index in range(1, num_rounds + 1):
        for workload in workloads:
            for dtype in DTYPES:
                target = out / f"{workload}-{dtype}-{peer}-r{round_index}.json"
                command = bench_command(workload, dtype, target, peer, num_threads, num_requests, engine_settings)
                print(f"[cpu-matrix] round {round_index}: {' '.join(command[1:])}", flush=True)
                subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    if not is_breakdown:
        return
    command = [sys.executable, "-m", "batchgen.bench.step_breakdown", "--dtype", ",".join(DTYPES), "--rounds",
               str(num_rounds), "--output", str(out / "breakdown.json")]
    if num_threads is not None:
        command += ["--threads", str(num_threads)]
    if num_requests is not None:
        command += ["--num-requests", str(num_requests)]
    print(f"[cpu-matrix] {' '.join(command[1:])}", flush=True)
    subprocess.run(command, check=True)


def summarize(out: Path) -> str:
    """Medians per (workload, dtype) over the rounds' JSON files in `out`."""
    rows, last = [], None
    for workload in WORKLOADS:
        for dtype in DTYPES:
            results = [json.loads(p.read_text()) for p in sorted(out.glob(f"{workload}-{dtype}-*-r*.json"))]
            if not results:
                continue
            last = results[-1]
            ours = [r["engine_runs"]["engine"]["completion_tokens_per_s"] for r in results]
            theirs = [r["peer"]["completion_tokens_per_s"] for r in results]
            ratios = [r["ratio_vs_peer"] for r in results]
            agree = results[-1]["agreement"]["engine vs peer"]
            kernels = results[-1].get("kernels", {})
            rows.append(f"| {workload} | {dtype} ({kernels.get('bf16_path') or 'float32'}) | "
                        f"{statistics.median(ours):.1f} ({min(ours):.1f}-{max(ours):.1f}) | "
                        f"{statistics.median(theirs):.1f} ({min(theirs):.1f}-{max(theirs):.1f}) | "
                        f"{statistics.median(ratios):.2f}x | {agree['num_exact']}/{agree['num_requests']} | "
                        f"{statistics.median(r['fraction_of_roofline'] for r in results):.1%} | {len(results)} |")
    cpu = last["machine"]["cpu"] if last else "?"
    isa = last.get("kernels", {}).get("cpu_isa") if last else "?"
    threads = _thread_settings(last) if last else "?"
    lines = [f"{cpu}, kernels at {isa}; {threads}; medians (min-max) over rounds, completion tokens/s",
             "| workload | dtype (path) | batchgen | vLLM CPU | ratio | greedy identical | of roofline | rounds |",
             "|---|---|---|---|---|---|---|---|", *rows]
    breakdown = out / "breakdown.json"
    if breakdown.exists():
        from batchgen.bench.step_breakdown import format_breakdown

        result = json.loads(breakdown.read_text())
        lines += ["", format_breakdown(result)]
        speeds = {d: s["median_completion_tokens_per_s"] for d, s in result["dtypes"].items()}
        if {"float32", "bfloat16"} <= speeds.keys():
            lines.append(f"bfloat16 / float32 (engine alone): {speeds['bfloat16'] / speeds['float32']:.2f}x")
    return "\n".join(lines)


def _thread_settings(result: dict) -> str:
    """How many threads each side ran: batchgen's torch threads of the CPUs, vLLM's OpenMP binding."""
    machine = result.get("machine", {})
    env = (result.get("peer") or {}).get("env") or {}
    binding = env.get("VLLM_CPU_OMP_THREADS_BIND") or "auto (vLLM's default)"
    return (f"batchgen {machine.get('num_threads', '?')} torch threads of {machine.get('num_cpus', '?')} CPUs, "
            f"vLLM OpenMP binding {binding}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmark-results/cpu-matrix"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None,
                        help="pin both engines to this many threads (default: each engine's own default, as its "
                             "public LLM gets it)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated: random, chat")
    parser.add_argument("--num-requests", type=int, default=None, help="requests per run (default: the bench's)")
    parser.add_argument("--no-breakdown", action="store_true", help="skip the bf16 / float32 breakdown")
    parser.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE",
                        help="an engine setting for every bench run (repeatable), e.g. kv_cache_memory=512MiB")
    parser.add_argument("--summarize", type=Path, default=None, help="only print the table of an earlier run")
    args = parser.parse_args(argv)
    if args.summarize is None:
        workloads = tuple(w for w in args.workloads.split(",") if w)
        unknown = set(workloads) - set(WORKLOADS)
        if unknown:
            parser.error(f"--workloads takes {', '.join(WORKLOADS)}; got {', '.join(sorted(unknown))}")
        run_matrix(args.out, args.rounds, args.threads, workloads=workloads, num_requests=args.num_requests,
                   is_breakdown=not args.no_breakdown, engine_settings=tuple(args.engine))
    print(summarize(args.summarize or args.out))


if __name__ == "__main__":
    main()
