"""`batchgen bench`: typer options to BenchOptions, the result printed or written. The bench modules
that run a workload are imported only when the command runs."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Annotated

import typer

from batchgen.bench.gemm_rate import PREFILL_NUM_TOKENS
from batchgen.bench.options import DEFAULT_MODEL
from batchgen.bench.peer import DEFAULT_BATCH_SIZES
from batchgen.bench.workloads import WORKLOADS


def _parse_batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers like 16,32,64; got {text!r}") from None
    if not sizes or any(s < 1 for s in sizes):
        raise typer.BadParameter(f"batch sizes must be positive integers; got {text!r}")
    return sizes


def _parse_rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated request rates like 1,4; got {text!r}") from None
    if not rates or any(r <= 0 for r in rates):
        raise typer.BadParameter(f"request rates must be positive; got {text!r}")
    return rates


def _say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def bench_command(
    workload: Annotated[str, typer.Option(help=f"One of: {', '.join(WORKLOADS)}.")] = "random",
    model: Annotated[str, typer.Option(help="Model alias, HF folder or .gguf file.")] = DEFAULT_MODEL,
    num_requests: Annotated[int | None, typer.Option(
        help="Requests (default 64; chat: the whole prompt set; score: contexts, default 32; reward: prompts, "
             "default 250, 4 completions each).")] = None,
    input_len_min: Annotated[int, typer.Option(
        help="random: shortest prompt in tokens; overhead: every prompt's length; score: shortest context.")] = 100,
    input_len_max: Annotated[int, typer.Option(help="random: longest prompt in tokens; score: longest context.")] = 200,
    output_len: Annotated[int, typer.Option(
        help="Completion tokens per request (fixed, EOS ignored); overhead: timed decode steps; score: tokens "
             "per continuation (4 per context).")] = 64,
    seed: Annotated[int, typer.Option(help="Seed for random prompts and shared-prefix messages.")] = 0,
    peer: Annotated[str | None, typer.Option(
        "--peer", help="hf: HF transformers generate (default; none for shared-prefix); vllm: vLLM's CPU build "
                       "in its own environment (make vllm-peer); none.")] = None,
    no_peer: Annotated[bool, typer.Option("--no-peer", help="The engine alone (as --peer none).")] = False,
    dtype: Annotated[str, typer.Option(
        help="The engine's model.dtype: float32, bfloat16 or auto (what it picks on this CPU); the peer runs "
             "the same.")] = "float32",
    vllm_reps: Annotated[int, typer.Option(help="--peer vllm: timed repetitions (its fastest is reported).")] = 2,
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
        "--quality", help="Run the quality bench (FP8, and --quantization's: agreement and KL against float32) "
                          "instead; on a GPTQ / AWQ / compressed-tensors --model, that checkpoint against its "
                          "dequantized weights in float32 first.")] = False,
    quantization: Annotated[str | None, typer.Option(
        "--quantization", help="int8,int4: also run the engine with those weights over the same workload "
                               "(with --quality: also compare them).")] = None,
    request_rates: Annotated[str, typer.Option(
        help="serve: Poisson request rates (req/s) to run, comma-separated.")] = "1,4",
    max_concurrency: Annotated[int, typer.Option(help="serve: streaming clients at most in flight.")] = 16,
    kv_cache_dtype: Annotated[str | None, typer.Option(
        "--kv-cache-dtype", help="fp8 | fp8_e4m3 | fp8_e5m2: with --quality, that KV cache against float32's; "
                                 "otherwise the engine's KV cache (as --engine kv_cache_dtype=...).")] = None,
    copy_batches: Annotated[str, typer.Option(help="copy: running batches to measure.")] = "1,8,64",
    spec_tokens: Annotated[int, typer.Option(help="copy: speculative tokens per verify (k).")] = 4,
    draft_model: Annotated[str | None, typer.Option(help="copy: the draft model (default: the model itself).")] = None,
    draft_quantization: Annotated[str | None, typer.Option(
        help="copy: the draft's quantization, e.g. fp8 (default: none).")] = None,
    structured_schema: Annotated[Path | None, typer.Option(
        "--structured-schema", help="random/chat/shared-prefix: a JSON schema file constraining every request, "
                                    "run against the same workload unconstrained (interleaved runs; the "
                                    "throughput ratio and the token mask's time per step), e.g. "
                                    "benchmark-results/schemas/records.json.")] = None,
    structured_runs: Annotated[int, typer.Option(help="--structured-schema: interleaved run pairs.")] = 3,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    output: Annotated[Path | None, typer.Option(
        help="Also write the JSON result here, e.g. benchmark-results/random-2core.json.")] = None,
) -> None:
    """Throughput of the engine against a peer (HF transformers, or vLLM's CPU build) on one workload,
    with roofline and agreement.

    `--workload serve`: `batchgen serve` under streaming clients at Poisson request rates (TTFT/TPOT
    percentiles as the client sees them) beside the same prompts offline.
    """
    from batchgen.bench.copy_bench import format_copy_report
    from batchgen.bench.engine_side import parse_engine_overrides
    from batchgen.bench.harness import run_bench, run_quality
    from batchgen.bench.machine import machine_fingerprint
    from batchgen.bench.options import BenchOptions
    from batchgen.bench.overhead import format_overhead, run_overhead
    from batchgen.bench.peer import PeerUnavailable
    from batchgen.bench.peers.vllm_cpu import VllmPeerUnavailable
    from batchgen.bench.quality import format_quality_table
    from batchgen.bench.report import format_report

    try:
        overrides = parse_engine_overrides(engine)
        if kv_cache_dtype and not quality:
            overrides["kv_cache_dtype"] = kv_cache_dtype
        opts = BenchOptions(workload=workload, model=model, num_requests=num_requests, input_len_min=input_len_min,
                            input_len_max=input_len_max, output_len=output_len, seed=seed,
                            peer="none" if no_peer else peer, dtype=dtype, vllm_reps=vllm_reps,
                            peer_batch_sizes=_parse_batch_sizes(peer_batch_sizes),
                            engine_overrides=overrides, num_threads=threads,
                            prompts=prompts, prefill_gemm_tokens=gemm_tokens, is_warmup=warmup, is_quality=quality,
                            kv_cache_dtype=kv_cache_dtype, num_speculative_tokens=spec_tokens,
                            draft_model=draft_model, draft_quantization=draft_quantization,
                            copy_batches=tuple(_parse_batch_sizes(copy_batches)),
                            structured_schema=str(structured_schema) if structured_schema else None,
                            structured_runs=structured_runs,
                            quantizations=[q for q in (quantization or "").replace(" ", "").split(",") if q])
        if opts.is_quality:
            result = run_quality(opts)
        elif opts.workload == "overhead":
            result = run_overhead(prompt_len=opts.input_len_min, steps=opts.output_len, seed=opts.seed)
            result["machine"] = machine_fingerprint()
        elif opts.workload == "moe-layer":
            from batchgen.bench.moe_layer import run_moe_layer

            if opts.num_threads:
                import torch

                torch.set_num_threads(opts.num_threads)
            result = run_moe_layer(opts.dtype, opts.seed)
            result["machine"] = machine_fingerprint()
        elif opts.workload == "serve":
            from batchgen.bench.serve_load import run_serve_bench  # needs the serve extra (httpx)

            log_dir = Path(tempfile.mkdtemp(prefix="batchgen-bench-serve-"))  # the server's log
            result = run_serve_bench(opts, _parse_rates(request_rates), max_concurrency, log_dir, _say)
        elif opts.workload == "reward":
            from batchgen.bench.reward_bench import DEFAULT_NUM_PROMPTS, run_reward_bench

            if opts.dtype != "float32":  # its rewards are compared with HF's float32 logits
                raise ValueError(f"--workload reward runs float32; got --dtype {opts.dtype}")
            result = run_reward_bench(opts.model, num_prompts=opts.num_requests or DEFAULT_NUM_PROMPTS,
                                      input_len_min=opts.input_len_min, input_len_max=opts.input_len_max,
                                      output_len=opts.output_len, seed=opts.seed, num_threads=opts.num_threads,
                                      is_peer=opts.is_peer, overrides=overrides, say=_say)
        elif opts.workload == "lora":
            from batchgen.bench.lora_bench import run_lora_bench

            result = run_lora_bench(opts.model, num_requests=opts.num_requests or 64, input_len_min=opts.input_len_min,
                                    input_len_max=opts.input_len_max, output_len=opts.output_len, seed=opts.seed,
                                    num_threads=opts.num_threads, overrides=overrides, say=_say)
        else:
            result = run_bench(opts)
    except (ValueError, FileNotFoundError, PeerUnavailable, VllmPeerUnavailable) as exc:
        typer.echo(f"batchgen bench: {exc}", err=True)
        raise typer.Exit(2) from None
    args = sys.argv[1:]
    args = args[1:] if args[:1] == ["bench"] else args  # the same line from `batchgen bench` and `python -m`
    result["command"] = " ".join(["batchgen", "bench", *args])
    text = json.dumps(result, indent=2)
    if output:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(text + "\n")
        typer.echo(f"batchgen bench: result written to {output}", err=True)  # stderr: --json's stdout stays JSON
    if as_json:
        typer.echo(text)
    elif opts.is_quality:
        typer.echo(format_quality_table(result["quality"]))
    elif opts.workload == "overhead":
        typer.echo(format_overhead(result))
    elif opts.workload == "copy":
        typer.echo(format_copy_report(result))
    elif opts.workload == "moe-layer":
        from batchgen.bench.moe_layer import format_moe_layer

        typer.echo(format_moe_layer(result))
    elif opts.workload == "score":
        from batchgen.bench.score_bench import format_score_report

        typer.echo(format_score_report(result))
    elif opts.workload == "reward":
        from batchgen.bench.reward_bench import format_reward_report

        typer.echo(format_reward_report(result))
    elif opts.workload == "lora":
        from batchgen.bench.lora_bench import format_lora_report

        typer.echo(format_lora_report(result))
    elif opts.workload == "serve":
        from batchgen.bench.serve_load import format_serve_report

        typer.echo(format_serve_report(result))
    elif opts.structured_schema is not None:
        from batchgen.bench.structured_bench import format_structured_report

        typer.echo(format_structured_report(result))
    else:
        typer.echo(format_report(result))
