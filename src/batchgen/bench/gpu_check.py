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
import dataclasses
import gc
import json
import platform
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from batchgen.engine.config import EngineConfig
from batchgen.engine.core.llm_engine import LLMEngine
from batchgen.engine.loader.model_loader import LoadedModel, build_loaded_model
from batchgen.engine.models.config import ModelConfig
from batchgen.engine.quant.fp8_linear import Fp8Linear
from batchgen.engine.sampling.sampling_params import SamplingParams

HBM_BYTES_PER_S = 4.8e12  # H200
# Rounding to E4M3 moves a weight by <= 2**-4 of itself, RMS <= 2**-4/sqrt(3); activations too: x sqrt(2).
W8A16_REL_BOUND = 2.0**-4 / 3**0.5
W8A8_REL_BOUND = 2**0.5 * W8A16_REL_BOUND


def llama3_8b_config(num_layers: int = 32) -> ModelConfig:
    return ModelConfig(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_layers=num_layers, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                       rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False)


def small_config() -> ModelConfig:
    """The correctness model: Llama-shaped (GQA 4:1, head_dim 64), small enough to run in seconds."""
    return ModelConfig(model_type="llama", vocab_size=4096, hidden_size=256, intermediate_size=512, num_layers=2,
                       num_heads=4, num_kv_heads=1, head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                       max_position_embeddings=1024, tie_word_embeddings=False)


def tiny_config() -> ModelConfig:
    return ModelConfig(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                       max_position_embeddings=512, tie_word_embeddings=False)


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


# ---- models ----------------------------------------------------------------------------------------
def seeded_init(seed: int, device: torch.device):
    def fill(model: torch.nn.Module) -> None:
        gen = torch.Generator(device=device).manual_seed(seed)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0, 0.02, generator=gen)
    return fill


def hf_llama(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int):
    """HF transformers' LlamaForCausalLM of this shape, seeded random weights, built in `dtype` on `device`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                         intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                         num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                         head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
                         rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
                         tie_word_embeddings=cfg.tie_word_embeddings, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None)
    previous = torch.get_default_dtype()
    torch.manual_seed(seed)
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(hf_cfg)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def engine_config(device: torch.device, dtype: torch.dtype, max_model_len: int, **overrides) -> EngineConfig:
    return EngineConfig(model="random", device=str(device), dtype=str(dtype).removeprefix("torch."),
                        max_model_len=max_model_len, **overrides)


def supported_overrides(overrides: dict) -> tuple[dict, list[str]]:
    """The overrides this build's EngineConfig has, and the names it lacks."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    return {k: v for k, v in overrides.items() if k in fields}, [k for k in overrides if k not in fields]


def free_device_memory() -> None:
    """Collect what the callers' dropped references left (an engine holds reference cycles, so its KV
    pool outlives its last name until the collector runs) and hand torch's cached blocks back, so the
    next engine's pool sizing sees the memory free. Callers drop every reference first: a name still
    bound to the previous engine (a loop variable, a frame kept by a traceback) keeps its pool."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- 1. correctness --------------------------------------------------------------------------------
def random_prompts(num: int, length: tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(*length))] for _ in range(num)]


def engine_greedy(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"c{i}", None, params, prompt_token_ids=prompt)
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out.outputs[0].token_ids
    return [outputs[f"c{i}"] for i in range(len(prompts))]


@torch.inference_mode()
def hf_greedy_each(hf_model, prompts: list[list[int]], max_tokens: int, device: torch.device) -> list[list[int]]:
    """HF generate one prompt at a time (no padding: the plainest reference), EOS off like the engine's
    ignore_eos (min_new_tokens would instead ban the EOS token, which greedy may pick)."""
    hf_model.generation_config.eos_token_id = None
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        out = hf_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=max_tokens, pad_token_id=0)
        outs.append(out[0, len(prompt):].tolist())
    return outs


def check_correctness(args: argparse.Namespace, device: torch.device) -> dict:
    """Engine vs HF on the same weights, float32 (identical greedy tokens) and bfloat16 (agreement)."""
    cfg = tiny_config() if args.tiny else small_config()
    num_tokens = 4 if args.tiny else 32
    prompts = random_prompts(2 if args.tiny else 8, (5, 40), cfg.vocab_size, seed=3)
    result = {"model": args.model or "random small llama", "num_prompts": len(prompts), "num_tokens": num_tokens}
    for dtype in (torch.float32, torch.bfloat16):
        result[str(dtype).removeprefix("torch.")] = _compare_with_hf(args, cfg, dtype, device, prompts, num_tokens)
        free_device_memory()  # the engine, its model and HF's died with the call's frame
    result["ok"] = result["float32"]["identical_requests"] == len(prompts)
    return result


def _compare_with_hf(args: argparse.Namespace, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                     prompts: list[list[int]], num_tokens: int) -> dict:
    config = engine_config(device, dtype, 256, attention_backend=args.attention_backend,
                           max_num_seqs=len(prompts), kv_cache_memory="1GiB" if device.type == "cuda" else "auto",
                           num_kv_blocks=None if device.type == "cuda" else 64)
    if args.model:
        from transformers import AutoModelForCausalLM

        from batchgen.engine.loader.model_loader import load_model

        config = config.replace(model=args.model)
        loaded = load_model(config)
        hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    else:
        hf = hf_llama(cfg, dtype, device, seed=0)
        state = hf.state_dict()
        loaded = build_loaded_model(config, cfg, 256, lambda model: model.load_weights(state.items()))
    engine = LLMEngine(config, loaded=loaded)
    ours = engine_greedy(engine, prompts, num_tokens)
    reference = hf_greedy_each(hf, prompts, num_tokens, device)
    same = sum(a == b for a, b in zip(ours, reference))
    matching = sum(x == y for a, b in zip(ours, reference) for x, y in zip(a, b))
    return {"attention_backend": engine.capabilities.attention_backend, "identical_requests": same,
            "matching_tokens": matching, "num_tokens": len(prompts) * num_tokens}


@torch.inference_mode()
def check_fp8_matmuls(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, num_tokens: int = 64) -> list[dict]:
    """Relative error vs a float32 matmul: the model dtype, w8a8 and w8a16 at every layer shape."""
    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    for name, (n, k) in cfg.linear_shapes().items():
        linear = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.float32)
        linear.weight.normal_(0, 0.02, generator=gen)
        x = torch.randn(num_tokens, k, device=device, generator=gen)
        ref = linear(x)
        linear = linear.to(dtype)
        row = {"layer": name, "shape": [num_tokens, k, n], "dtype": rel_error(linear(x.to(dtype)), ref)}
        fp8 = Fp8Linear.from_linear(linear)
        for mode in ("w8a8", "w8a16"):
            fp8.set_mode(mode)
            row[mode] = rel_error(fp8(x.to(dtype)), ref)
        row["ok"] = row["w8a8"] < W8A8_REL_BOUND and row["w8a16"] < W8A16_REL_BOUND * 1.1  # dtype rounding on top
        rows.append(row)
    return rows


def rel_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


# ---- 2. speed --------------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


# ---- 4. tensor parallelism -------------------------------------------------------------------------
def save_hf_folder(hf_model, folder: Path) -> Path:
    """The HF model as an HF folder (config.json, safetensors) with a word-level tokenizer of its
    vocabulary ("t0", "t1", ...): what every tensor-parallel rank loads its shard from."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    hf_model.save_pretrained(folder, safe_serialization=True)
    vocab = {f"t{i}": i for i in range(hf_model.config.vocab_size)}
    words = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", eos_token="t1").save_pretrained(folder)
    return folder


def check_tensor_parallel(args: argparse.Namespace, device: torch.device, record) -> dict:
    """tp=N against tp=1 on the same folder: greedy tokens (float32 identical, bfloat16 agreement), then
    the speed model's bf16 decode at 64 sequences (completion tok/s) at both sizes."""
    size = args.tensor_parallel_size
    cfg = tiny_config() if args.tiny else small_config()
    num_tokens = 4 if args.tiny else 32
    prompts = random_prompts(2 if args.tiny else 8, (5, 40), cfg.vocab_size, seed=3)
    result: dict = {"tensor_parallel_size": size, "num_prompts": len(prompts), "num_tokens": num_tokens}
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_hf_folder(hf_llama(cfg, torch.float32, torch.device("cpu"), seed=0), Path(tmp) / "small")
        for dtype in (torch.float32, torch.bfloat16):
            tokens = {}
            for tp in (1, size):
                config = engine_config(device, dtype, 256, attention_backend=args.attention_backend,
                                       max_num_seqs=len(prompts), tensor_parallel_size=tp,
                                       kv_cache_memory="1GiB" if device.type == "cuda" else "auto",
                                       num_kv_blocks=None if device.type == "cuda" else 64).replace(model=str(folder))
                engine = LLMEngine(config)
                tokens[tp] = engine_greedy(engine, prompts, num_tokens)
                engine.shutdown()
                del engine  # no name keeps its pool (free_device_memory's rule)
                free_device_memory()
            pairs = list(zip(tokens[1], tokens[size]))
            result[str(dtype).removeprefix("torch.")] = {
                "identical_requests": sum(a == b for a, b in pairs),
                "matching_tokens": sum(x == y for a, b in pairs for x, y in zip(a, b)),
                "num_tokens": len(prompts) * num_tokens}
            record()
        result["ok"] = result["float32"]["identical_requests"] == len(prompts)
        speed_cfg = tiny_config() if args.tiny else llama3_8b_config(args.layers)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        folder = save_hf_folder(hf_llama(speed_cfg, dtype, device, seed=0), Path(tmp) / "speed")
        free_device_memory()
        sc = SpeedConfig("decode x64", 64, 64, (128, 128), 128) if not args.tiny else \
            SpeedConfig("decode x4", 4, 4, (8, 8), 8)
        max_model_len = 64 if args.tiny else 4096
        result["speed"] = []
        for tp in (1, size):
            config = engine_config(device, dtype, max_model_len, attention_backend=args.attention_backend,
                                   max_num_seqs=sc.max_num_seqs, tensor_parallel_size=tp,
                                   num_kv_blocks=None if device.type == "cuda"
                                   else sc.max_num_seqs * (-(-max_model_len // 16)) + 1).replace(model=str(folder))
            try:
                engine = LLMEngine(config)
            except ValueError as exc:  # tp=1 of a model that needs more than one GPU
                result["speed"].append({"tensor_parallel_size": tp, "skipped": str(exc)})
                continue
            row = run_speed_config(engine, dataclasses.replace(sc, name=f"{sc.name} tp={tp}"), seed=1,
                                   clock=args.clock)
            result["speed"].append({"tensor_parallel_size": tp, **row})
            engine.shutdown()
            del engine
            free_device_memory()
            record()
    return result


# ---- the run ---------------------------------------------------------------------------------------
def format_table(result: dict) -> str:
    lines = [f"{'configuration':<32} {'tok/s':>10} {'decode tok/s':>13} {'roofline':>9}  notes"]
    speed = result.get("speed", [])
    for row in speed if isinstance(speed, list) else []:
        if "skipped" in row:
            lines.append(f"{row['name']:<32} {'-':>10} {'-':>13} {'-':>9}  skipped: {row['skipped']}")
            continue
        if "error" in row:
            lines.append(f"{row['name']:<32} {'-':>10} {'-':>13} {'-':>9}  FAILED: {row['error'][:200]}")
            continue
        notes = f"{row['attention_backend']}, graphs {'on' if row['cuda_graphs'] else 'off'}"
        if row.get("cuda_graphs_sizes"):
            notes += (f" ({row['cuda_graphs_sizes']} captured in {row['cuda_graphs_capture_seconds']:.1f} s, "
                      f"{row['cuda_graphs_memory_bytes'] / 2**30:.2f} GiB; reserved "
                      f"{row.get('cuda_graphs_reserved_bytes', 0) / 2**30:.2f} GiB)")
        if "stopped_at_time_limit" in row:
            notes += f", cut short at {row['stopped_at_time_limit']:.0f} s"
        lines.append(f"{row['name']:<32} {row['completion_tokens_per_s']:>10.1f} {row['decode_tokens_per_s']:>13.1f} "
                     f"{row['decode_fraction_of_roofline']:>9.1%}  {notes}")
        if row.get("kv_plan"):
            lines.append(f"{'':<32} KV plan: {row['kv_plan']}")
    if isinstance(speed, dict) and "error" in speed:
        lines.append(f"speed FAILED: {speed['error'][:300]}")
    peer = result.get("peer")
    if peer and "completion_tokens_per_s" in peer:
        lines.append(f"{peer['name']:<32} {peer['completion_tokens_per_s']:>10.1f} {'':>13} {'':>9}  peer")
    t = result.get("tensor_parallel")
    if t and "speed" in t:  # not an error or a skip (those are listed below)
        for row in t["speed"]:
            if "skipped" not in row:
                lines.append(f"{row['name']:<32} {row['completion_tokens_per_s']:>10.1f} "
                             f"{row['decode_tokens_per_s']:>13.1f} {row['decode_fraction_of_roofline']:>9.1%}  "
                             f"per GPU's shard")
        for name in ("float32", "bfloat16"):
            lines.append(f"tensor parallel {name}: {t[name]['identical_requests']}/{t['num_prompts']} requests "
                         f"identical at tp={t['tensor_parallel_size']} and tp=1, {t[name]['matching_tokens']}/"
                         f"{t[name]['num_tokens']} tokens")
    kernels = result.get("kernels") or {}
    attention = kernels.get("decode_attention")
    for row in attention if isinstance(attention, list) else []:
        lines.append(f"decode attention {row['case']}: unsplit {row['unsplit_gb_per_s']:.0f} GB/s "
                     f"({row['unsplit_fraction_of_hbm']:.0%} of HBM), split {row['split_gb_per_s']:.0f} GB/s "
                     f"({row['split_fraction_of_hbm']:.0%}, {row['num_splits']} splits), same bits: "
                     f"{row['split_equals_unsplit_bitwise']}; {row['tiles']}")
        for tiles, rate in row.get("candidates", {}).items():
            lines.append(f"    candidate {tiles}: {rate} GB/s")
    sampler = kernels.get("sampler")
    if sampler:
        ms = sampler["ms"]
        lines.append(f"sampler N={sampler['num_rows']} V={sampler['vocab']}: " + ", ".join(
            f"{name} {value:.2f} ms" + (f" ({sampler['over_greedy'][name]:.2f}x greedy)" if name != "greedy" else "")
            for name, value in ms.items()))
    for name in ("correctness", "fp8_matmuls", "kernels", "peer", "tensor_parallel"):
        part = result.get(name)
        if isinstance(part, dict) and "error" in part:
            lines.append(f"{name} FAILED: {part['error'][:300]}")
    c = result.get("correctness")
    if c and "float32" in c:
        for name in ("float32", "bfloat16"):
            r = c[name]
            lines.append(f"correctness {name}: {r['identical_requests']}/{c['num_prompts']} requests identical to HF, "
                         f"{r['matching_tokens']}/{r['num_tokens']} tokens ({r['attention_backend']})")
    m = result.get("fp8_matmuls")
    if isinstance(m, list):
        lines.append("fp8 matmuls: " + ", ".join(f"{r['layer']} w8a8 {r['w8a8']:.4f} w8a16 {r['w8a16']:.4f}"
                                                 for r in m))
    if result.get("part_seconds"):
        lines.append("seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in result["part_seconds"].items()))
    return "\n".join(lines)


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
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
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


if __name__ == "__main__":
    sys.exit(main())
