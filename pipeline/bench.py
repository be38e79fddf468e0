"""`batchgen bench`: one workload through the engine and, in the same run, through HF transformers.

Both sides get the same model, the same prompt token ids, greedy decoding with a fixed output
length, the same thread count; the clock covers generation only (not loading or tokenizing). The
run also measures the machine's float32 GEMM rate at the model's shapes, derives the workload's
roofline from it, and counts how many requests' greedy tokens agree between the two sides.
"""

from __future__ import annotations

import datetime
import gc
import importlib.util
import inspect
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import torch
import typer

from batchgen.engine import LLMEngine
from batchgen.engine.cpu_allocator import keep_freed_memory
from batchgen.pipeline.bench_engine import build_engine, parse_engine_overrides, run_engine
from batchgen.pipeline.bench_peer import (
    DEFAULT_BATCH_SIZES,
    PeerUnavailable,
    load_peer_model,
    run_peer,
    warm_up_peer,
)
from batchgen.pipeline.bench_report import format_report
from batchgen.pipeline.bench_result import RunResult, compare_outputs
from batchgen.pipeline.bench_workloads import (
    WORKLOADS,
    Workload,
    chat_workload,
    random_workload,
    shared_prefix_workload,
    special_token_ids,
)
from batchgen.pipeline.gemm_rate import DECODE_NUM_TOKENS, PREFILL_NUM_TOKENS, measure_gemm_rate
from batchgen.pipeline.roofline import workload_roofline

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_NUM_REQUESTS = 64  # random and shared-prefix; chat takes the whole prompt set
QUALITY_MODULE = "batchgen.engine.quant.quality"


@dataclass
class BenchOptions:
    """Everything a bench run depends on; the CLI fills it, tests build it directly."""

    workload: str = "random"
    model: str = DEFAULT_MODEL
    num_requests: int | None = None  # None: 64 (random, shared-prefix) or the whole set (chat)
    input_len_min: int = 100
    input_len_max: int = 200
    output_len: int = 64
    seed: int = 0
    peer: bool | None = None  # None: on, except for shared-prefix
    peer_batch_sizes: list[int] = field(default_factory=lambda: list(DEFAULT_BATCH_SIZES))
    engine_overrides: dict = field(default_factory=dict)
    num_threads: int | None = None  # None: torch's default
    prompts: str | None = None  # chat prompt set; None: jobs/data/chat_prompts.parquet
    prefill_gemm_tokens: int = PREFILL_NUM_TOKENS
    decode_gemm_tokens: int = DECODE_NUM_TOKENS
    gemm_min_seconds: float = 0.3
    is_warmup: bool = True
    is_quality: bool = False  # run the FP8 quality bench instead of the throughput comparison

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}; got {self.workload!r}")

    @property
    def is_peer(self) -> bool:
        return self.peer if self.peer is not None else self.workload != "shared-prefix"


def _say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


# ---- pieces --------------------------------------------------------------------------------------
def make_workload(opts: BenchOptions, engine: LLMEngine) -> Workload:
    tokenizer = engine.tokenizer
    if opts.workload == "random":
        return random_workload(opts.num_requests or DEFAULT_NUM_REQUESTS, opts.input_len_min, opts.input_len_max,
                               opts.output_len, opts.seed, engine.model_cfg.vocab_size,
                               special_token_ids(tokenizer.hf))
    if opts.workload == "chat":
        return chat_workload(tokenizer, opts.output_len, opts.prompts, opts.num_requests)
    return shared_prefix_workload(tokenizer, opts.num_requests or DEFAULT_NUM_REQUESTS, opts.output_len, opts.seed)


def _warm_up_engine(engine: LLMEngine, opts: BenchOptions) -> None:
    """A few short random requests (another seed: they share no prefix with the workload)."""
    warmup = random_workload(4, 16, 48, 4, opts.seed + 7919, engine.model_cfg.vocab_size,
                             special_token_ids(engine.tokenizer.hf))
    run_engine(engine, warmup, "warmup")


def _timed_engine_run(engine: LLMEngine, workload: Workload, opts: BenchOptions, name: str,
                      say: Callable[[str], None]) -> RunResult:
    if opts.is_warmup:
        _warm_up_engine(engine, opts)
    say(f"{name}: {workload.num_requests} requests")
    result = run_engine(engine, workload, name)
    say(f"{name}: {result.completion_tokens_per_s:.1f} completion tokens/s")
    return result


def engine_with(engine: LLMEngine, **changes) -> LLMEngine:
    """A fresh engine (empty prefix cache, zeroed counters) with `changes` to the settings, sharing
    the loaded weights where the engine supports it (`weights_from`), else loading them again."""
    config = engine.config.replace(**changes)
    if "weights_from" in inspect.signature(LLMEngine.__init__).parameters:
        return LLMEngine(config, weights_from=engine)
    return LLMEngine(config)


def _machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    import transformers

    return {"cpu": cpu, "num_cpus": os.cpu_count(), "num_threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "git_commit": _git_commit(),
            "glibc_malloc_tuned": keep_freed_memory()}  # both sides, see run_bench


def _cpu_busy_fraction(window_s: float = 0.5) -> float | None:
    """Share of all CPUs' time spent busy over a short window while this process idles (Linux)."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
        return sum(values) - idle, sum(values)

    try:
        busy0, total0 = sample()
        time.sleep(window_s)
        busy1, total1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return (busy1 - busy0) / (total1 - total0) if total1 > total0 else None


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=Path(__file__).parent, capture_output=True, text=True,
                             timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _git_commit() -> str | None:
    """The source commit, with '+dirty' when tracked files differ from it (recorded results must say)."""
    commit = _git("rev-parse", "--short", "HEAD")
    if commit and _git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    return commit


def _fairness(workload: Workload, sides: list[RunResult]) -> list[str]:
    """Reasons the comparison is not like for like (empty: every side did the same token work)."""
    reasons = []
    for side in sides:
        if side.num_prompt_tokens != workload.num_prompt_tokens:
            reasons.append(f"{side.name} read {side.num_prompt_tokens} prompt tokens, "
                           f"the workload has {workload.num_prompt_tokens}")
        if side.num_completion_tokens != workload.num_completion_tokens:
            reasons.append(f"{side.name} generated {side.num_completion_tokens} tokens, "
                           f"the workload asks for {workload.num_completion_tokens}")
    return reasons


def _quality_module():
    """The FP8 quality bench (issue 6) lives in the engine; None where this install lacks it."""
    if importlib.util.find_spec(QUALITY_MODULE) is None:
        return None
    from importlib import import_module

    module = import_module(QUALITY_MODULE)
    return module if hasattr(module, "run_quality_bench") else None


def run_quality(opts: BenchOptions) -> dict:
    """`--quality`: FP8 against the unquantized model on the same text (top-1 agreement, KL, greedy)."""
    module = _quality_module()
    if module is None:
        raise ValueError(f"--quality needs {QUALITY_MODULE}.run_quality_bench, which this install lacks")
    if opts.num_threads:
        torch.set_num_threads(opts.num_threads)
    return {"model": opts.model, "quality": module.run_quality_bench(opts.model, num_prompts=opts.num_requests),
            "machine": _machine()}


def format_quality(result: dict) -> str:
    module = _quality_module()
    if module is not None and hasattr(module, "format_quality_table"):
        return module.format_quality_table(result["quality"])
    return json.dumps(result["quality"], indent=2)


# ---- the run -------------------------------------------------------------------------------------
def run_bench(opts: BenchOptions, engine: LLMEngine | None = None, peer_model=None,
              say: Callable[[str], None] = _say) -> dict:
    """Run the bench; returns the result dict (`--json` prints it as is).

    `engine` and `peer_model` may be given already loaded (tests share session fixtures); the
    engine must be float32 on the CPU like the peer.
    """
    busy_before = _cpu_busy_fraction()  # before our own work: is the machine busy with someone else's?
    if opts.num_threads:
        torch.set_num_threads(opts.num_threads)
    # The engine raises glibc's malloc thresholds at start; it is process-wide, so set it before
    # either side runs: engine and peer measure under the same allocator (the peer gains from it too).
    keep_freed_memory()
    if opts.is_peer and peer_model is None:
        from batchgen.pipeline.bench_peer import require_peer_dependencies

        require_peer_dependencies()  # fail before minutes of engine work, not after
    if engine is None:
        say(f"loading the engine ({opts.model})")
        engine = build_engine(opts.model, opts.num_threads, opts.engine_overrides)
    workload = make_workload(opts, engine)
    model_cfg = engine.model_cfg
    eos_token_ids = list(engine.eos_token_ids)
    pad_token_id = engine.tokenizer.hf.pad_token_id
    pad_token_id = eos_token_ids[0] if pad_token_id is None else pad_token_id

    engine_runs: dict[str, RunResult] = {}
    if opts.workload == "shared-prefix":
        # Caching on and off over the same prompts, each in a fresh engine (no cache carried over).
        on = engine_with(engine, enable_prefix_caching=True)
        engine_runs["engine"] = _timed_engine_run(on, workload, opts, "engine (prefix caching on)", say)
        off = engine_with(engine, enable_prefix_caching=False)
        engine_runs["engine_no_prefix_caching"] = _timed_engine_run(off, workload, opts,
                                                                    "engine (prefix caching off)", say)
        del on, off, engine
    else:
        engine_runs["engine"] = _timed_engine_run(engine, workload, opts, "engine", say)
        del engine
    gc.collect()

    peer: RunResult | None = None
    if opts.is_peer:
        if peer_model is None:
            say(f"loading the peer (HF transformers, {opts.model})")
            peer_model = load_peer_model(opts.model)
        if opts.is_warmup:
            warm_up_peer(peer_model, pad_token_id, eos_token_ids)
        say(f"peer: batch sizes {opts.peer_batch_sizes}")
        peer, _ = run_peer(peer_model, workload, opts.peer_batch_sizes, pad_token_id, eos_token_ids)
        say(f"peer: best {peer.completion_tokens_per_s:.1f} completion tokens/s at batch {peer.details['batch_size']}")

    say("measuring the float32 GEMM rate at the model's shapes")
    prefill = measure_gemm_rate(model_cfg, opts.prefill_gemm_tokens, opts.gemm_min_seconds)
    decode = measure_gemm_rate(model_cfg, opts.decode_gemm_tokens, opts.gemm_min_seconds)
    roofline = workload_roofline(model_cfg, workload.prompt_lens, workload.output_lens, prefill.layer_flops_per_s)

    main = engine_runs["engine"]
    sides = list(engine_runs.values()) + ([peer] if peer else [])
    unfair = _fairness(workload, sides)
    result: dict = {
        "model": opts.model,
        "workload": workload.describe(),
        "machine": {**_machine(), "cpu_busy_before": busy_before},
        "engine_runs": {key: run.as_dict() for key, run in engine_runs.items()},
        "peer": peer.as_dict() if peer else None,
        "gemm": {"prefill": prefill.as_dict(), "decode": decode.as_dict()},
        "roofline": roofline.as_dict(),
        "fraction_of_roofline": main.completion_tokens_per_s / roofline.completion_tokens_per_s,
        "is_fair": not unfair,
        "unfair_reasons": unfair,
        "agreement": {},
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if peer:
        result["ratio_vs_peer"] = main.completion_tokens_per_s / peer.completion_tokens_per_s
        result["agreement"]["engine vs peer"] = _agreement(main, peer)
    if "engine_no_prefix_caching" in engine_runs:
        off = engine_runs["engine_no_prefix_caching"]
        result["ratio_prefix_caching"] = main.completion_tokens_per_s / off.completion_tokens_per_s
        result["agreement"]["prefix caching on vs off"] = _agreement(main, off)
    return result


def _agreement(ours: RunResult, theirs: RunResult) -> dict:
    agreement = compare_outputs(ours, theirs).as_dict()
    agreement["mismatched_request_ids"] = [i for i, t in ours.output_token_ids.items()
                                           if t != theirs.output_token_ids.get(i)][:20]
    return agreement


# ---- command line --------------------------------------------------------------------------------
def _parse_batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers like 16,32,64; got {text!r}") from None
    if not sizes or any(s < 1 for s in sizes):
        raise typer.BadParameter(f"batch sizes must be positive integers; got {text!r}")
    return sizes


def bench_command(
    workload: Annotated[str, typer.Option(help=f"One of: {', '.join(WORKLOADS)}.")] = "random",
    model: Annotated[str, typer.Option(help="Model alias, HF folder or .gguf file.")] = DEFAULT_MODEL,
    num_requests: Annotated[int | None, typer.Option(
        help="Requests (default 64; chat: the whole prompt set).")] = None,
    input_len_min: Annotated[int, typer.Option(help="random: shortest prompt in tokens.")] = 100,
    input_len_max: Annotated[int, typer.Option(help="random: longest prompt in tokens.")] = 200,
    output_len: Annotated[int, typer.Option(help="Completion tokens per request (fixed, EOS ignored).")] = 64,
    seed: Annotated[int, typer.Option(help="Seed for random prompts and shared-prefix messages.")] = 0,
    peer: Annotated[bool | None, typer.Option(
        "--peer/--no-peer", help="Also run HF transformers generate (default on; off for shared-prefix).")] = None,
    peer_batch_sizes: Annotated[str, typer.Option(
        help="Peer batch sizes to try; its fastest is reported.")] = ",".join(map(str, DEFAULT_BATCH_SIZES)),
    engine: Annotated[list[str] | None, typer.Option(
        "--engine", help="Engine setting KEY=VALUE (repeatable), e.g. max_num_seqs=64.")] = None,
    threads: Annotated[int | None, typer.Option(help="torch threads for both sides (default: torch's).")] = None,
    prompts: Annotated[str | None, typer.Option(
        help="chat: Parquet prompt set (default jobs/data/chat_prompts.parquet).")] = None,
    gemm_tokens: Annotated[int, typer.Option(help="Rows of the prefill-shape GEMM measurement.")] = PREFILL_NUM_TOKENS,
    warmup: Annotated[bool, typer.Option("--warmup/--no-warmup", help="Warm both sides up untimed.")] = True,
    quality: Annotated[bool, typer.Option(
        "--quality", help="Run the FP8 quality bench (agreement and KL against float32) instead.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    output: Annotated[Path | None, typer.Option(
        help="Also write the JSON result here, e.g. benchmarks/results/random-2core.json.")] = None,
) -> None:
    """Throughput of the engine against HF transformers on one workload, with roofline and agreement."""
    try:
        opts = BenchOptions(workload=workload, model=model, num_requests=num_requests, input_len_min=input_len_min,
                            input_len_max=input_len_max, output_len=output_len, seed=seed, peer=peer,
                            peer_batch_sizes=_parse_batch_sizes(peer_batch_sizes),
                            engine_overrides=parse_engine_overrides(engine), num_threads=threads,
                            prompts=prompts, prefill_gemm_tokens=gemm_tokens, is_warmup=warmup, is_quality=quality)
        result = run_quality(opts) if opts.is_quality else run_bench(opts)
    except (ValueError, FileNotFoundError, PeerUnavailable) as exc:
        typer.echo(f"batchgen bench: {exc}", err=True)
        raise typer.Exit(2) from None
    args = sys.argv[1:]
    args = args[1:] if args[:1] == ["bench"] else args  # the same line from `batchgen bench` and `python -m`
    result["command"] = " ".join(["batchgen", "bench", *args])
    text = json.dumps(result, indent=2)
    if output:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(text + "\n")
    typer.echo(text if as_json else (format_quality(result) if opts.is_quality else format_report(result)))


def main() -> None:
    typer.run(bench_command)


if __name__ == "__main__":
    main()
