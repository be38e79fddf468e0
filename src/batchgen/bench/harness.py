"""One `batchgen bench` run: a workload through the engine and, in the same run, through a peer: HF
transformers in this process, or vLLM's CPU build in its own environment (bench/peers/vllm_cpu.py).

Both sides get the same model, the same prompt token ids, greedy decoding with a fixed output
length, the same dtype and thread count; the clock covers generation only (not loading, compiling or
tokenizing). The run also measures the machine's GEMM rate at the model's shapes in the dtype the
engine's GEMMs compute in, derives the workload's roofline from it, and counts how many requests'
greedy tokens agree between the two sides.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import sys
from collections.abc import Callable

import torch

from batchgen.bench.copy_bench import SWITCH_OUTPUT_LEN, run_copy_bench
from batchgen.bench.engine_side import build_engine, run_engine
from batchgen.bench.gemm_rate import measure_gemm_rate
from batchgen.bench.machine import cpu_busy_fraction, machine_fingerprint
from batchgen.bench.options import DEFAULT_MODEL, DEFAULT_NUM_REQUESTS, BenchOptions
from batchgen.bench.peer import load_peer_model, require_peer_dependencies, run_peer, warm_up_peer
from batchgen.bench.peers.vllm_cpu import VllmPeerConfig, kv_cache_gib, run_vllm_peer
from batchgen.bench.quality import run_dtype_quality_bench, run_kv_cache_quality_bench, run_quality_bench
from batchgen.bench.result import TimedRun, compare_outputs
from batchgen.bench.roofline import workload_roofline
from batchgen.bench.workloads import (
    Workload,
    chat_workload,
    random_workload,
    shared_prefix_workload,
    special_token_ids,
)
from batchgen.engine import LLMEngine
from batchgen.engine.config import EngineConfig
from batchgen.engine.runner.cpu_allocator import keep_freed_memory


def _say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


# ---- pieces --------------------------------------------------------------------------------------
def make_workload(opts: BenchOptions, engine: LLMEngine) -> Workload:
    tokenizer = engine.tokenizer
    if opts.workload in ("random", "serve", "moe"):
        workload = random_workload(opts.num_requests or DEFAULT_NUM_REQUESTS, opts.input_len_min,
                                   opts.input_len_max, opts.output_len, opts.seed, engine.model_cfg.vocab_size,
                                   special_token_ids(tokenizer.hf))
        return dataclasses.replace(workload, name="moe") if opts.workload == "moe" else workload
    if opts.workload == "chat":
        return chat_workload(tokenizer, opts.output_len, opts.prompts, opts.num_requests)
    return shared_prefix_workload(tokenizer, opts.num_requests or DEFAULT_NUM_REQUESTS, opts.output_len, opts.seed)


def _warm_up_engine(engine: LLMEngine, opts: BenchOptions) -> None:
    """A few short random requests (another seed: they share no prefix with the workload)."""
    warmup = random_workload(4, 16, 48, 4, opts.seed + 7919, engine.model_cfg.vocab_size,
                             special_token_ids(engine.tokenizer.hf))
    run_engine(engine, warmup, "warmup")


def _timed_engine_run(engine: LLMEngine, workload: Workload, opts: BenchOptions, name: str,
                      say: Callable[[str], None]) -> TimedRun:
    if opts.is_warmup:
        _warm_up_engine(engine, opts)
    say(f"{name}: {workload.num_requests} requests")
    result = run_engine(engine, workload, name)
    say(f"{name}: {result.completion_tokens_per_s:.1f} completion tokens/s")
    return result


def _timed_moe_engine_run(engine: LLMEngine, workload: Workload, opts: BenchOptions,
                          say: Callable[[str], None]) -> tuple[TimedRun, dict]:
    """The engine's timed run with its MoE layers timed too (warm-up untimed, as in _timed_engine_run)."""
    from batchgen.bench.moe_model import moe_summary, timing_moe_layers

    if opts.is_warmup:
        _warm_up_engine(engine, opts)
    say(f"engine: {workload.num_requests} requests (MoE layers timed)")
    with timing_moe_layers(engine.runner.model) as clock:
        result = run_engine(engine, workload, "engine")
    moe = moe_summary(engine.model_cfg, clock.seconds, clock.num_calls, result.seconds)
    say(f"engine: {result.completion_tokens_per_s:.1f} completion tokens/s; MoE layers "
        f"{moe['moe_share_of_run']:.1%} of the run")
    return result, moe


def engine_with(engine: LLMEngine, **changes) -> LLMEngine:
    """A fresh engine (empty prefix cache, zeroed counters) with `changes` to the settings, sharing
    the loaded weights."""
    return LLMEngine(engine.config.replace(**changes), weights_from=engine)


def _fairness(workload: Workload, sides: list[TimedRun]) -> list[str]:
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


def run_quality(opts: BenchOptions) -> dict:
    """`--quality`: FP8 against the unquantized model on the same text (top-1 agreement, KL, greedy);
    with `--kv-cache-dtype fp8`: the FP8 KV cache against the float32 cache instead; with `--dtype
    bfloat16`: the bfloat16 model (as it runs on this CPU) against float32, and greedy against HF's bf16."""
    if opts.num_threads:
        torch.set_num_threads(opts.num_threads)
    if opts.dtype not in ("float32", "auto") or (opts.dtype == "auto" and EngineConfig(
            model=opts.model, device="cpu").torch_dtype != torch.float32):
        dtype = "bfloat16" if opts.dtype == "auto" else opts.dtype
        quality = run_dtype_quality_bench(opts.model, dtype, num_prompts=opts.num_requests)
    elif opts.kv_cache_dtype not in (None, "auto"):
        quality = run_kv_cache_quality_bench(
            opts.model, opts.kv_cache_dtype, num_prompts=opts.num_requests,
            calculate_kv_scales=bool(opts.engine_overrides.get("calculate_kv_scales", False)))
    else:
        calibration = opts.engine_overrides.get("int_calibration", EngineConfig.int_calibration)
        quality = run_quality_bench(opts.model, num_prompts=opts.num_requests, int_methods=opts.quantizations,
                                    int_calibrations=(calibration,))
    return {"model": opts.model, "quality": quality, "machine": machine_fingerprint()}


# ---- the run -------------------------------------------------------------------------------------
def run_bench(opts: BenchOptions, engine: LLMEngine | None = None, peer_model=None,
              say: Callable[[str], None] = _say) -> dict:
    """Run the bench; returns the result dict (`--json` prints it as is).

    `engine` and `peer_model` may be given already loaded (tests share session fixtures); the
    engine runs on the CPU, and the peer in the engine's dtype.
    """
    busy_before = cpu_busy_fraction()  # before our own work: is the machine busy with someone else's?
    if opts.num_threads:
        torch.set_num_threads(opts.num_threads)
    if opts.workload == "moe" and engine is None and opts.model == DEFAULT_MODEL:
        # No --model: the small random-weight MoE, written once (bench/moe_model.py).
        from batchgen.bench.moe_model import default_moe_folder, make_moe_folder

        say("the MoE bench model (random weights, written once)")
        opts = dataclasses.replace(opts, model=str(make_moe_folder(default_moe_folder(seed=opts.seed),
                                                                   seed=opts.seed)))
    # The engine raises glibc's malloc thresholds at start; it is process-wide, so set it before
    # either side runs: engine and peer measure under the same allocator (the peer gains from it too).
    keep_freed_memory()
    vllm = VllmPeerConfig.for_model(opts.model) if opts.peer_kind == "vllm" else None
    if vllm is not None:
        vllm.check()  # fail before minutes of engine work, not after
    elif opts.is_peer and peer_model is None:
        require_peer_dependencies()
    if engine is None:
        say(f"loading the engine ({opts.model}, dtype {opts.dtype})")
        overrides = opts.engine_overrides
        if opts.workload == "score" and "kv_cache_memory" not in overrides:
            # Only its weights serve: each side builds its own pool, sized for the workload (score_bench.py).
            overrides = {**overrides, "kv_cache_memory": "512MiB"}
        engine = build_engine(opts.model, opts.num_threads, overrides, opts.dtype)
    dtype = engine.config.torch_dtype  # what `auto` resolved to: the peer runs the same
    if opts.workload == "copy":
        if opts.is_peer and peer_model is None:
            say(f"loading the peer (HF transformers, {opts.model})")
            peer_model = load_peer_model(opts.model, dtype)
        return run_copy_bench(engine, peer_model if opts.is_peer else None,
                              num_speculative_tokens=opts.num_speculative_tokens,
                              draft_model=opts.draft_model or engine.config.model,
                              draft_quantization=opts.draft_quantization, max_tokens=opts.output_len,
                              num_requests_at_batch_1=opts.num_requests or 8,
                              switch_output_len=SWITCH_OUTPUT_LEN, say=say, batches=tuple(opts.copy_batches))
    if opts.workload == "score":
        from batchgen.bench.score_bench import DEFAULT_NUM_CONTEXTS, run_score_bench

        if opts.is_peer and peer_model is None:
            say(f"loading the peer (HF transformers, {opts.model})")
            peer_model = load_peer_model(opts.model, dtype)
        return run_score_bench(engine, peer_model if opts.is_peer else None,
                               num_contexts=opts.num_requests or DEFAULT_NUM_CONTEXTS,
                               input_len_min=opts.input_len_min, input_len_max=opts.input_len_max,
                               continuation_len=opts.output_len, seed=opts.seed, say=say)
    workload = make_workload(opts, engine)
    if opts.structured_schema is not None:  # constrained against unconstrained, nothing else
        from batchgen.bench.structured_bench import run_structured_comparison

        structured = run_structured_comparison(engine, workload, opts.structured_schema, opts.structured_runs, say)
        return {"model": opts.model, "workload": workload.describe(),
                "machine": {**machine_fingerprint(), "cpu_busy_before": busy_before}, "structured": structured,
                "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    model_cfg = engine.model_cfg
    eos_token_ids = list(engine.eos_token_ids)
    pad_token_id = engine.tokenizer.hf.pad_token_id
    pad_token_id = eos_token_ids[0] if pad_token_id is None else pad_token_id
    engine_config, kv_pool_bytes = engine.config, engine.num_kv_blocks * engine.config.block_size * engine.kv_bytes_per_token
    kernels = engine.capabilities.as_dict()
    max_model_len = engine.max_model_len

    engine_runs: dict[str, TimedRun] = {}
    moe: dict | None = None
    if opts.workload == "moe":
        engine_runs["engine"], moe = _timed_moe_engine_run(engine, workload, opts, say)
        del engine
    elif opts.workload == "shared-prefix":
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
    for method in opts.quantizations:  # the same workload with integer weights quantized at load
        say(f"loading the engine with {method} weights")
        quantized = build_engine(opts.model, opts.num_threads, {**opts.engine_overrides, "quantization": method},
                                 opts.dtype)
        engine_runs[f"engine_{method}"] = _timed_engine_run(quantized, workload, opts, f"engine ({method} weights)", say)
        engine_runs[f"engine_{method}"].details["weights"] = quantized.stats["weights"]
        del quantized
        gc.collect()

    peer: TimedRun | None = None
    if vllm is not None:
        # vLLM gets the engine's scheduler limits and KV budget (whole GiB), the same threads and dtype.
        vllm.dtype, vllm.num_threads, vllm.seed = str(dtype).removeprefix("torch."), opts.num_threads, opts.seed
        vllm.kv_cache_gib, vllm.num_reps = kv_cache_gib(kv_pool_bytes), opts.vllm_reps
        vllm.max_num_seqs, vllm.max_num_batched_tokens = engine_config.max_num_seqs, engine_config.max_num_batched_tokens
        vllm.max_model_len = min(max_model_len, max(workload.prompt_lens) + max(workload.output_lens) + 64)
        say(f"peer: vLLM CPU ({vllm.dtype}, {opts.vllm_reps} timed repetitions; load and compile untimed)")
        peer = run_vllm_peer(vllm, workload, say)
        say(f"peer: {peer.completion_tokens_per_s:.1f} completion tokens/s "
            f"(load + compile {peer.details['load_seconds']:.0f} s, untimed)")
    elif opts.is_peer:
        if peer_model is None:
            say(f"loading the peer (HF transformers, {opts.model})")
            peer_model = load_peer_model(opts.model, dtype)
        if opts.is_warmup:
            warm_up_peer(peer_model, pad_token_id, eos_token_ids)
        say(f"peer: batch sizes {opts.peer_batch_sizes}")
        peer, _ = run_peer(peer_model, workload, opts.peer_batch_sizes, pad_token_id, eos_token_ids)
        say(f"peer: best {peer.completion_tokens_per_s:.1f} completion tokens/s at batch {peer.details['batch_size']}")

    gemm_dtype = gemm_compute_dtype(kernels)
    say(f"measuring the {str(gemm_dtype).removeprefix('torch.')} GEMM rate at the model's shapes")
    prefill = measure_gemm_rate(model_cfg, opts.prefill_gemm_tokens, opts.gemm_min_seconds, dtype=gemm_dtype)
    decode = measure_gemm_rate(model_cfg, opts.decode_gemm_tokens, opts.gemm_min_seconds, dtype=gemm_dtype)
    roofline = workload_roofline(model_cfg, workload.prompt_lens, workload.output_lens, prefill.layer_flops_per_s)

    main = engine_runs["engine"]
    sides = list(engine_runs.values()) + ([peer] if peer else [])
    unfair = _fairness(workload, sides)
    result: dict = {
        "model": opts.model,
        "workload": workload.describe(),
        "machine": {**machine_fingerprint(), "cpu_busy_before": busy_before},
        "engine_runs": {key: run.as_dict() for key, run in engine_runs.items()},
        "dtype": str(dtype).removeprefix("torch."),
        "kernels": kernels,
        "peer_kind": opts.peer_kind,
        "peer": peer.as_dict() if peer else None,
        "gemm": {"dtype": str(gemm_dtype).removeprefix("torch."), "prefill": prefill.as_dict(),
                 "decode": decode.as_dict()},
        "roofline": roofline.as_dict(),
        "fraction_of_roofline": main.completion_tokens_per_s / roofline.completion_tokens_per_s,
        "is_fair": not unfair,
        "unfair_reasons": unfair,
        "agreement": {},
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if moe is not None:
        result["moe"] = moe
    if peer:
        result["ratio_vs_peer"] = main.completion_tokens_per_s / peer.completion_tokens_per_s
        result["agreement"]["engine vs peer"] = _agreement(main, peer)
    for method in opts.quantizations:
        run = engine_runs[f"engine_{method}"]
        result.setdefault("ratio_quantized", {})[method] = run.completion_tokens_per_s / main.completion_tokens_per_s
        result["agreement"][f"{method} vs float32"] = _agreement(run, main)
    if "engine_no_prefix_caching" in engine_runs:
        off = engine_runs["engine_no_prefix_caching"]
        result["ratio_prefix_caching"] = main.completion_tokens_per_s / off.completion_tokens_per_s
        result["agreement"]["prefix caching on vs off"] = _agreement(main, off)
    return result


def gemm_compute_dtype(kernels: dict) -> torch.dtype:
    """The dtype the engine's GEMMs multiply in: bfloat16 on BF16 units, float32 otherwise (float32
    weights, or bfloat16 weights widened to float32 in the kernel)."""
    return torch.bfloat16 if kernels.get("compute_dtype") == "bfloat16" else torch.float32


def _agreement(ours: TimedRun, theirs: TimedRun) -> dict:
    agreement = compare_outputs(ours, theirs).as_dict()
    agreement["mismatched_request_ids"] = [i for i, t in ours.output_token_ids.items()
                                           if t != theirs.output_token_ids.get(i)][:20]
    return agreement
