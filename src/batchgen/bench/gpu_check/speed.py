"""Parts 2 and 3: the speed configurations (each on an engine of its own), the kernels alone (decode
attention, one sampler step) and the peer (HF generate)."""

from __future__ import annotations

import argparse
import dataclasses
import time
import traceback

import torch

from batchgen.bench.gpu_check.models import (
    engine_config,
    free_device_memory,
    hf_llama,
    llama3_8b_config,
    random_prompts,
    seeded_init,
    supported_overrides,
    sync,
    tiny_config,
)
from batchgen.engine.config import EngineConfig
from batchgen.engine.core.llm_engine import LLMEngine
from batchgen.engine.loader.model_loader import LoadedModel, build_loaded_model
from batchgen.engine.models.config import ModelConfig
from batchgen.engine.sampling.sampling_params import SamplingParams

HBM_BYTES_PER_S = 4.8e12  # H200


@dataclasses.dataclass
class SpeedConfig:
    name: str
    num_requests: int
    max_num_seqs: int
    prompt_len: tuple[int, int]  # (min, max) tokens
    output_len: int
    engine: dict = dataclasses.field(default_factory=dict)  # EngineConfig overrides
    fp8_weights: bool = False


def speed_configs(tiny: bool) -> list[SpeedConfig]:
    """At most 8; FP8 weights last (its model replaces the bf16 one)."""
    scale = 16 if tiny else 1
    b64, b256 = max(64 // scale, 2), max(256 // scale, 4)
    p, o = ((16, 16), 4) if tiny else ((512, 512), 128)
    return [
        SpeedConfig("bf16 decode x1", 1, 1, p, o * (1 if tiny else 2)),
        SpeedConfig(f"bf16 decode x{b64}", b64, b64, p, o),
        SpeedConfig(f"bf16 decode x{b256}", b256, b256, p, o),
        SpeedConfig(f"bf16 graphs off x{b64}", b64, b64, p, o, {"enforce_eager": True}),
        SpeedConfig(f"fp8 KV x{b256}", b256, b256, p, o, {"kv_cache_dtype": "fp8"}),
        SpeedConfig(f"mixed prefill+decode x{2 * b256}", 2 * b256, b256, (16, 48) if tiny else (256, 1024),
                    o * 2, {"max_num_batched_tokens": 128 if tiny else 4096}),
        SpeedConfig(f"fp8 weights x{b256}", b256, b256, p, o, fp8_weights=True),
    ]


def run_speed_config(engine: LLMEngine, sc: SpeedConfig, seed: int, clock=time.perf_counter,
                     time_limit: float = float("inf")) -> dict:
    """Time the workload; decode-only steps are timed apart, with the KV tokens they read. Past
    `time_limit` seconds the unfinished requests are aborted and the row says so (its rates are over
    the tokens made until then)."""
    device = engine.config.torch_device
    vocab = engine.model_cfg.vocab_size
    warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for i in range(min(sc.max_num_seqs, 4)):  # compiles kernels; untimed
        engine.add_request(f"w{i}", None, warm, prompt_token_ids=[1 + i] * 8)
    while engine.has_unfinished():
        engine.step()
    prompts = random_prompts(sc.num_requests, sc.prompt_len, vocab, seed)
    params = SamplingParams(temperature=0.0, max_tokens=sc.output_len, ignore_eos=True)
    stats = engine.scheduler.stats
    decode_seconds = 0.0
    decode_tokens = 0
    decode_kv_tokens = 0
    decode_steps = 0
    completion = 0
    is_cut_short = False
    sync(device)
    start = clock()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"s{i}", None, params, prompt_token_ids=prompt)
    while engine.has_unfinished():
        if clock() - start > time_limit:
            is_cut_short = True
            for request_id in list(engine.requests):
                completion += sum(seq.num_output_tokens for seq in engine.sequences(request_id))
                engine.abort_request(request_id)
            break
        prefill_before, decode_before = stats.num_prefill_tokens, stats.num_decode_tokens
        kv_tokens = sum(s.num_tokens for s in engine.scheduler.running)
        t0 = clock()
        finished = engine.step()
        t1 = clock()
        completion += sum(len(o.outputs[0].token_ids) for o in finished)
        if stats.num_prefill_tokens == prefill_before and stats.num_decode_tokens > decode_before:
            decode_seconds += t1 - t0
            decode_tokens += stats.num_decode_tokens - decode_before
            decode_kv_tokens += kv_tokens
            decode_steps += 1
    sync(device)
    seconds = clock() - start
    kv_bytes_per_token = engine.kv_bytes_per_token
    roofline_seconds = (decode_steps * engine.weight_bytes + decode_kv_tokens * kv_bytes_per_token) / HBM_BYTES_PER_S
    row = {
        "name": sc.name, "num_requests": sc.num_requests, "max_num_seqs": sc.max_num_seqs,
        "prompt_len": list(sc.prompt_len), "output_len": sc.output_len, "completion_tokens": completion,
        "seconds": seconds, "completion_tokens_per_s": completion / seconds if seconds else 0.0,
        "decode_steps": decode_steps, "decode_tokens_per_s": decode_tokens / decode_seconds if decode_seconds else 0.0,
        "decode_fraction_of_roofline": roofline_seconds / decode_seconds if decode_seconds else 0.0,
        "weight_bytes": engine.weight_bytes, "kv_bytes_per_token": kv_bytes_per_token,
        "attention_backend": engine.capabilities.attention_backend,
        "cuda_graphs": engine.runner.graphs is not None,
    }
    if is_cut_short:
        row["stopped_at_time_limit"] = time_limit
    return row


def speed_engine_config(sc: SpeedConfig, args: argparse.Namespace, device: torch.device, dtype: torch.dtype,
                        max_model_len: int) -> EngineConfig:
    base = {"attention_backend": args.attention_backend, "max_num_seqs": sc.max_num_seqs,
            "max_num_batched_tokens": max(4096, sc.max_num_seqs * 8),
            "quantization": "fp8" if sc.fp8_weights else "none"}
    base.update(supported_overrides(sc.engine)[0])
    if device.type != "cuda":
        base["num_kv_blocks"] = sc.max_num_seqs * (-(-max_model_len // 16)) + 1
    return engine_config(device, dtype, max_model_len, **base)


def run_speed(args: argparse.Namespace, device: torch.device, record) -> list[dict]:
    """Every speed configuration in turn, each on an engine of its own that is gone (with its KV pool)
    before the next one sizes its pool. A configuration that fails is recorded with its error and the
    next one runs; one that runs past args.config_time_limit is cut short and says so."""
    cfg = tiny_config() if args.tiny else llama3_8b_config(args.layers)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    max_model_len = 64 if args.tiny else 4096
    rows: list[dict] = []
    models: dict[bool, LoadedModel] = {}  # fp8_weights -> the model; at most one held at a time
    for sc in speed_configs(args.tiny)[:args.max_configs]:
        missing = supported_overrides(sc.engine)[1]
        if args.clock() - args.started > args.time_budget:
            rows.append({"name": sc.name, "skipped": f"past the run's time budget of {args.time_budget:.0f} s"})
            record(rows)
            continue
        if missing:
            rows.append({"name": sc.name, "skipped": f"this build's EngineConfig has no {', '.join(missing)}"})
            record(rows)
            continue
        started = args.clock()
        try:
            config = speed_engine_config(sc, args, device, dtype, max_model_len)
            if sc.fp8_weights not in models:
                models.clear()  # the other model goes before this one is built
                free_device_memory()
                models[sc.fp8_weights] = build_loaded_model(config, cfg, max_model_len, seeded_init(0, device))
            row = _run_on_fresh_engine(config, models[sc.fp8_weights], sc, args)
        except Exception as exc:  # noqa: BLE001 - recorded, and the next configuration still runs
            row = {"name": sc.name, "error": f"{type(exc).__name__}: {exc}",
                   "traceback": traceback.format_exc(limit=-4)}
        # The traceback (and with it the failed engine's frame) is gone once the handler ends.
        free_device_memory()
        row["wall_seconds"] = args.clock() - started
        rows.append(row)
        record(rows)
    models.clear()
    free_device_memory()
    return rows


def _run_on_fresh_engine(config: EngineConfig, loaded: LoadedModel, sc: SpeedConfig, args) -> dict:
    """One configuration on an engine that lives only in this frame."""
    engine = LLMEngine(config, loaded=loaded)
    row = run_speed_config(engine, sc, seed=1, clock=args.clock, time_limit=args.config_time_limit)
    if engine.gpu_memory is not None:
        row["kv_plan"] = engine.gpu_memory.describe()
        row["cuda_graphs_reserved_bytes"] = engine.gpu_memory.cuda_graphs
    graphs = engine.runner.graphs
    if graphs is not None:
        row["cuda_graphs_sizes"] = len(graphs.sizes)
        row["cuda_graphs_capture_seconds"] = graphs.capture_seconds
        row["cuda_graphs_memory_bytes"] = graphs.memory_bytes
    row["num_kv_blocks"] = engine.num_kv_blocks
    return row


# ---- kernels -------------------------------------------------------------------------------------
def check_kernels(args: argparse.Namespace, device: torch.device, cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """Decode attention alone and one sampler step (bench/gpu_kernels.py), where the Triton kernels run."""
    from batchgen.bench.gpu_kernels import decode_attention_figures, sampler_step_figures
    from batchgen.engine.attention.triton import TritonAttention

    result: dict = {}
    reason = TritonAttention.unavailable_reason(device, dtype, cfg.head_dim)
    if reason is None:
        result["decode_attention"] = decode_attention_figures(device, dtype, cfg.num_heads, cfg.num_kv_heads,
                                                              cfg.head_dim, HBM_BYTES_PER_S, args.tiny,
                                                              reps=1 if args.tiny else 10, warmups=0 if args.tiny else 2)
    else:
        result["decode_attention"] = {"skipped": f"the Triton backend cannot run here: {reason}"}
    result["sampler"] = sampler_step_figures(device, cfg.vocab_size, 8 if args.tiny else 256,
                                             reps=1 if args.tiny else 10, warmups=0 if args.tiny else 2)
    return result


# ---- 3. peer ---------------------------------------------------------------------------------------
@torch.inference_mode()
def run_peer(args: argparse.Namespace, device: torch.device, clock=time.perf_counter) -> dict:
    cfg = tiny_config() if args.tiny else llama3_8b_config(args.layers)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batch = 4 if args.tiny else 64
    prompt_len, output_len = (16, 4) if args.tiny else (512, 128)
    model = hf_llama(cfg, dtype, device, seed=0)
    model.generation_config.eos_token_id = None  # fixed length, like the engine's ignore_eos
    ids = torch.tensor(random_prompts(batch, (prompt_len, prompt_len), cfg.vocab_size, seed=1), device=device)
    kwargs = {"attention_mask": torch.ones_like(ids), "do_sample": False, "pad_token_id": 0}
    model.generate(input_ids=ids[:, :8], max_new_tokens=2, **{**kwargs, "attention_mask": torch.ones_like(ids[:, :8])})
    sync(device)
    start = clock()
    out = model.generate(input_ids=ids, max_new_tokens=output_len, **kwargs)
    sync(device)
    seconds = clock() - start
    completion = (out.shape[1] - prompt_len) * batch
    del model, out
    free_device_memory()
    return {"name": f"HF generate bf16 x{batch}" if device.type == "cuda" else f"HF generate x{batch}",
            "batch_size": batch, "prompt_len": prompt_len, "output_len": output_len, "completion_tokens": completion,
            "seconds": seconds, "completion_tokens_per_s": completion / seconds if seconds else 0.0}
