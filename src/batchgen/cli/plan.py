"""`batchgen plan MODEL_OR_JOB`: weights, KV cache and concurrency arithmetic without loading weights
(pipeline/capacity_plan.py computes and formats; this reads the argument and prints)."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from batchgen.cli.console import EXIT_BAD_JOB
from batchgen.engine.capabilities import cpu_report
from batchgen.pipeline.capacity_plan import (
    PlanTarget,
    format_capacity_plan,
    job_target,
    make_plan,
    model_target,
    smallest_fitting_tensor_parallel_size,
)
from batchgen.pipeline.config import load_job
from batchgen.pipeline.errors import JobError


def read_target(model_or_job: str, revision: str | None = None) -> PlanTarget:
    """A job file (.yaml/.yml) gives its model and engine settings; anything else names a model (a
    Hugging Face repo id at `revision`, too)."""
    if model_or_job.endswith((".yaml", ".yml")):
        return job_target(load_job(model_or_job))
    return model_target(model_or_job, revision)


def plan_command(
    model_or_job: Annotated[str, typer.Argument(
        metavar="MODEL_OR_JOB", show_default=False,
        help="A model (alias, HF folder - config.json is enough -, .gguf file, Hugging Face repo id) or a "
             "job file (.yaml).")],
    revision: Annotated[str | None, typer.Option(
        "--revision", help="A repo id's branch, tag or commit (default: main; a job file gives its own).")] = None,
    max_model_len: Annotated[int | None, typer.Option(
        "--max-model-len", min=1,
        help="Context length per request (default: the job's, else the model's).")] = None,
    concurrency: Annotated[int | None, typer.Option(
        "--concurrency", min=1,
        help="Concurrent requests (default: the job's engine.max_num_seqs, else 1).")] = None,
    dtype: Annotated[str | None, typer.Option(
        "--dtype",
        help="auto | float32 | bfloat16 | float16 (auto plans for bfloat16, the GPU default).")] = None,
    quantization: Annotated[str | None, typer.Option(
        "--quantization",
        help="auto | none | fp8 | int8 | int4 | gptq | awq | compressed-tensors | gguf (default: the "
             "job's, else auto: what the checkpoint declares).")] = None,
    memory: Annotated[str | None, typer.Option(
        "--memory", help="Device memory to fit, e.g. 80GB or 141GiB: prints how many requests fit.")] = None,
    kv_cache_dtype: Annotated[str | None, typer.Option(
        "--kv-cache-dtype",
        help="auto | fp8 | fp8_e4m3 | fp8_e5m2 (auto: the model dtype; fp8 = fp8_e4m3, 1 byte per value).")] = None,
    tensor_parallel_size: Annotated[int | None, typer.Option(
        "--tensor-parallel-size", min=1,
        help="GPUs one model is split over: sizes are per GPU (default: the job's, else 1). With "
             "--memory, the smallest size that fits is printed too.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON, sizes in bytes.")] = False,
) -> None:
    """Capacity plan: weights, KV cache per token and per request, total for a concurrency, what fits.

    Reads only the model's config (no weights). Text sizes are decimal GB; --json gives bytes.
    """
    try:
        target = read_target(model_or_job, revision)
        kv_pool = _job_kv_pool(model_or_job)
        options = {"max_model_len": max_model_len, "concurrency": concurrency, "dtype": dtype,
                   "quantization": quantization, "memory": memory, "kv_cache_dtype": kv_cache_dtype}
        plan = make_plan(target, tensor_parallel_size=tensor_parallel_size, **options)
        smallest = smallest_fitting_tensor_parallel_size(target, plan, **options) if memory is not None else None
    except JobError as exc:
        typer.echo(f"batchgen: bad input: {exc}", err=True)
        raise typer.Exit(EXIT_BAD_JOB) from None
    if json_out:
        extra = {"smallest_tensor_parallel_size": smallest} if memory is not None else {}
        if kv_pool is not None:
            extra["cpu_kv_pool"] = kv_pool
        typer.echo(json.dumps({"model": target.name, **plan.to_dict(), **extra, "cpu": cpu_report()}, indent=2))
    else:
        typer.echo(format_capacity_plan(target, plan, smallest))
        if kv_pool is not None:
            typer.echo(f"KV pool on this CPU (engine.kv_cache_memory auto): {kv_pool['sizing']}")


def _job_kv_pool(model_or_job: str) -> dict | None:
    """A job's CPU KV pool under kv_cache_memory auto, as its run will size it (pipeline/kv_budget.py):
    None for a model, a job with a set size, or a job that runs on a GPU."""
    if not model_or_job.endswith((".yaml", ".yml")):
        return None
    from batchgen.pipeline.job_plan import plan_job

    job = load_job(model_or_job)
    try:
        plan_job(job)  # reads the input: the bound needs its rows and prompt lengths
    except JobError as exc:
        return {"sizing": f"not sized here, the job's plan fails: {exc}"}
    budget = job.kv_budget
    if budget is None:
        return None
    return {"bytes": budget.num_bytes, "num_tokens": budget.num_tokens, "num_seqs": budget.num_seqs,
            "tokens_per_seq": budget.tokens_per_seq, "draft_bytes": budget.num_pool_bytes - budget.num_bytes,
            "cap_bytes": budget.cap_bytes, "sizing": budget.describe()}
