"""The capacity plan (`batchgen plan`): weights, KV cache and concurrency arithmetic without loading weights.

The numbers come from batchgen.engine.kv.capacity (the engine sizes its KV pool with the same
kv_bytes_per_token); this module only finds the model's config and formats the plan.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from batchgen.engine.capabilities import cpu_report
from batchgen.engine.config import EngineConfig, parse_memory_size
from batchgen.engine.kv.capacity import KV_FRAGMENTATION_FRACTION, CapacityPlan, plan_capacity
from batchgen.engine.models.config import ModelConfig
from batchgen.engine.quant.methods import DeclaredQuantization, declared_quantization, resolve_quantization
from batchgen.pipeline.errors import JobError

if TYPE_CHECKING:
    from batchgen.pipeline.job_config import JobConfig

AUTO_DTYPE = "bfloat16"  # `auto` is bfloat16 on a GPU, where capacity planning matters


@dataclass(frozen=True)
class PlanTarget:
    """What a MODEL_OR_JOB argument names: the model's config and the settings to plan with."""

    name: str
    model_cfg: ModelConfig
    dtype: str = "auto"
    quantization: str = "auto"
    int_calibration: str = EngineConfig.int_calibration
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None
    concurrency: int = 1
    block_size: int = EngineConfig.block_size
    max_num_batched_tokens: int = EngineConfig.max_num_batched_tokens
    declared: DeclaredQuantization | None = None  # the folder's quantization_config
    is_gguf: bool = False
    tensor_parallel_size: int = 1


def job_target(job: JobConfig) -> PlanTarget:
    """A job's model and engine settings to plan with."""
    cfg, declared, is_gguf = read_model(job.model.path, job.model.revision)
    return PlanTarget(
        name=f"{job.name} ({job.model.path})", model_cfg=cfg, dtype=job.model.dtype,
        quantization=job.model.quantization, int_calibration=job.model.int_calibration,
        kv_cache_dtype=job.engine.kv_cache_dtype, max_model_len=job.model.max_model_len, concurrency=job.engine.max_num_seqs,
        block_size=job.engine.block_size, max_num_batched_tokens=job.engine.max_num_batched_tokens,
        declared=declared, is_gguf=is_gguf, tensor_parallel_size=job.engine.tensor_parallel_size)


def model_target(path: str, revision: str | None = None) -> PlanTarget:
    """A model (a Hugging Face repo id at `revision`, too) with the engine's default settings."""
    cfg, declared, is_gguf = read_model(path, revision)
    return PlanTarget(name=path, model_cfg=cfg, declared=declared, is_gguf=is_gguf)


def read_model(path: str, revision: str | None = None) -> tuple[ModelConfig, DeclaredQuantization | None, bool]:
    """(config, the declared quantization_config or None, is a GGUF file) from an alias, an HF folder
    (config.json is enough), a .gguf or a Hugging Face repo id."""
    from batchgen.engine.loader.hf_loader import read_hf_config
    from batchgen.engine.loader.model_loader import read_declared_quantization, read_model_config
    from batchgen.engine.loader.source import resolve_model

    try:
        if "://" in path and not path.startswith("file://") and not path.endswith(".gguf"):
            return _read_remote_config(path)  # only config.json travels, never the weights
        source = resolve_model(path, revision, config_only=True)
        if source.is_gguf:
            return read_model_config(source), None, True
        cfg = read_hf_config(source.folder, is_plan_only=True)
        return cfg, _declared_besides_experts(cfg, lambda: read_declared_quantization(source)), False
    except (FileNotFoundError, ValueError) as exc:
        raise JobError(str(exc)) from None


def _declared_besides_experts(cfg: ModelConfig, read_declared) -> DeclaredQuantization | None:
    """The folder's declared quantization (`read_declared()`), except where its quantization_config is
    the experts' own format, already in the config (gpt-oss's MXFP4: moe_expert_format; every other
    weight unquantized): None then."""
    return None if cfg.moe_expert_format else read_declared()


def read_declared(path: str, revision: str | None = None) -> tuple[DeclaredQuantization | None, bool]:
    """(declared quantization, is a GGUF file) without parsing a GGUF file's metadata."""
    from batchgen.engine.loader.model_loader import read_declared_quantization
    from batchgen.engine.loader.source import resolve_model

    try:
        if "://" in path and not path.startswith("file://") and not path.endswith(".gguf"):
            return _read_remote_config(path)[1], False
        source = resolve_model(path, revision, config_only=True)
        return read_declared_quantization(source), source.is_gguf
    except (FileNotFoundError, ValueError) as exc:
        raise JobError(str(exc)) from None


def resolve_plan_quantization(requested: str, declared: DeclaredQuantization | None, is_gguf: bool,
                              where: str) -> str:
    """The engine's own resolution (engine/quant/methods.py); a conflict is a JobError naming both."""
    try:
        return resolve_quantization(requested, declared, is_gguf=is_gguf, where=where)
    except ValueError as exc:
        raise JobError(str(exc)) from None


def _read_remote_config(uri: str) -> tuple[ModelConfig, DeclaredQuantization | None, bool]:
    import fsspec

    config_uri = uri.rstrip("/") + "/config.json"
    try:
        with fsspec.open(config_uri, "r") as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {config_uri}: {exc}") from exc
    cfg = ModelConfig.from_hf_dict(raw, is_plan_only=True)
    return cfg, _declared_besides_experts(cfg, lambda: declared_quantization(raw, config_uri)), False


def make_plan(target: PlanTarget, max_model_len: int | None = None, concurrency: int | None = None,
              dtype: str | None = None, quantization: str | None = None,
              memory: str | None = None, kv_cache_dtype: str | None = None,
              tensor_parallel_size: int | None = None) -> CapacityPlan:
    """Command-line values override the job's; unset ones fall back to the job, then the model."""
    dtype_name = dtype or target.dtype
    try:  # the engine's own config checks the names and maps the dtype
        settings = EngineConfig(model=target.name, dtype=AUTO_DTYPE if dtype_name == "auto" else dtype_name,
                                quantization=quantization or target.quantization,
                                kv_cache_dtype=kv_cache_dtype or target.kv_cache_dtype,
                                tensor_parallel_size=tensor_parallel_size or target.tensor_parallel_size)
    except ValueError as exc:
        raise JobError(f"--{exc}") from None
    weight_format = resolve_plan_quantization(settings.quantization, target.declared, target.is_gguf, target.name)
    memory_bytes = None
    if memory is not None:
        try:
            memory_bytes = parse_memory_size(memory)
        except ValueError as exc:
            raise JobError(f"--memory: {exc}") from None
        if isinstance(memory_bytes, float):
            raise JobError(f"--memory is a size such as 80GB or 141GiB, not a fraction; got {memory!r}")
    length = max_model_len or target.max_model_len or target.model_cfg.max_position_embeddings
    try:
        return plan_capacity(
            target.model_cfg, settings.torch_dtype, length, concurrency or target.concurrency, weight_format,
            memory_bytes, target.block_size, target.max_num_batched_tokens, declared=target.declared,
            kv_dtype=settings.kv_torch_dtype, int_calibration=target.int_calibration,
            tensor_parallel_size=settings.tensor_parallel_size)
    except ValueError as exc:  # the model does not split over that many GPUs
        raise JobError(f"--tensor-parallel-size: {exc}") from None


def smallest_fitting_tensor_parallel_size(target: PlanTarget, plan: CapacityPlan, **options) -> int | None:
    """The fewest GPUs of plan.memory_bytes each that hold the plan's concurrency (tensor-parallel,
    every split the model allows: 1 up to its query heads); None when none does. `options`: make_plan's."""
    for size in range(1, target.model_cfg.num_heads + 1):
        try:
            candidate = make_plan(target, **{**options, "tensor_parallel_size": size})
        except JobError:  # the model does not split over `size`
            continue
        if candidate.fits:
            return size
    return None


_REST = "embeddings, norms, lm_head {dtype}"
WEIGHT_NOTES = {
    "none": "{dtype}",
    "gguf": "planned as {dtype} (the file's kept blocks are smaller: see the engine's weights report)",
    "fp8": "fp8 linear weights + per-channel float32 scales; " + _REST,
    "int8": "int8 linear weights + per-channel scales (+ per-column pre-quant scales, activation-aware); " + _REST,
    "int4": "int4 linear weights, groups of 128 with scales and zeros (+ per-column pre-quant scales, "
            "activation-aware); " + _REST,
    "gptq": "the checkpoint's GPTQ codes + scales (zeros, g_idx); " + _REST,
    "awq": "the checkpoint's AWQ codes + scales and zeros; " + _REST,
    "compressed-tensors": "the checkpoint's integer codes + scales (zeros); " + _REST,
}


def _gb(num_bytes: int) -> str:
    return f"{num_bytes / 1e9:,.2f} GB"


def format_capacity_plan(target: PlanTarget, plan: CapacityPlan, smallest: int | None = None) -> str:
    """What `batchgen plan` prints: the model, the settings, a table of sizes (one GPU's with tensor
    parallelism), what fits, and (with a memory size) the fewest GPUs that hold the plan (`smallest`)."""
    cfg = target.model_cfg
    dtype = str(plan.dtype).removeprefix("torch.")
    kv_dtype = str(plan.kv_dtype or plan.dtype).removeprefix("torch.")
    weights_note = WEIGHT_NOTES.get(plan.quantization, "{dtype}").format(dtype=dtype)
    tp = plan.tensor_parallel_size
    num_kv_heads = plan.kv_bytes_per_token // (2 * cfg.num_layers * cfg.head_dim * _kv_dtype_bytes(plan))
    num_kv_values = 2 * cfg.num_layers * num_kv_heads * cfg.head_dim
    requests = f"{plan.concurrency} concurrent request" + ("s" if plan.concurrency != 1 else "")
    heads_note = f"{num_kv_heads} KV heads" + (f" (of {cfg.num_kv_heads}, on one GPU)" if tp > 1 else "")
    rows = [
        ("weights", _gb(plan.weight_bytes), weights_note + (f"; one GPU's shard of {tp}" if tp > 1 else "")),
        ("KV cache per token", f"{plan.kv_bytes_per_token:,} B",
         (f"2 x {cfg.num_layers} layers x {heads_note} x {cfg.head_dim} head_dim x "
          f"{plan.kv_bytes_per_token // num_kv_values} bytes ({kv_dtype})")),
        ("KV cache per request", _gb(plan.kv_bytes_per_request), f"{plan.kv_tokens_per_request:,} tokens"),
        (f"KV cache x {plan.concurrency}", _gb(plan.kv_bytes), requests),
    ]
    if plan.num_local_layers:  # the sliding-window layers' own block group keeps only their window
        num_global = cfg.num_layers - plan.num_local_layers
        rows[-2] = ("KV cache per request", _gb(plan.kv_bytes_per_request),
                    f"{plan.kv_tokens_per_request:,} tokens in {num_global} global layers, "
                    f"{plan.local_kv_tokens_per_request:,} in {plan.num_local_layers} sliding-window layers "
                    f"(window {plan.local_window:,})")
        rows[-1] = (f"KV cache x {plan.concurrency}", _gb(plan.kv_bytes),
                    f"{requests} + one step's {plan.max_num_batched_tokens:,} tokens in the sliding-window "
                    f"layers ({_gb(plan.local_step_reserve_bytes)})")
    rows += [
        ("total before margin", _gb(plan.total_bytes_before_margin), "weights + KV"),
        ("  fragmentation margin", _gb(plan.fragmentation_bytes), f"{KV_FRAGMENTATION_FRACTION:.0%} of KV"),
        ("  activation workspace", _gb(plan.activation_bytes),
         f"{plan.max_num_batched_tokens:,} batched tokens, {plan.concurrency} sampled rows"),
        ("total with margin", _gb(plan.total_bytes), ""),
    ]
    if cfg.is_moe:  # every expert resident; a token reads its top k (engine/kv/expert_bytes.py)
        one_gpu = " on one GPU" if tp > 1 else ""
        rows[1:1] = [
            ("  experts", f"{cfg.num_experts} x top {cfg.num_experts_per_tok}"
             + (", MXFP4 as published, dequantized at load" if cfg.moe_expert_format == "mxfp4" else ""),
             f"{plan.num_parameters / 1e9:,.2f} B parameters, {plan.num_active_parameters / 1e9:,.2f} B active per token"),
            ("  decode reads, 1 seq", _gb(plan.decode_weight_bytes_one),
             f"weights a decode step reads{one_gpu}: {1e12 / plan.decode_weight_bytes_one:,.0f} steps/s per TB/s"),
            (f"  decode reads, {plan.concurrency} seqs", _gb(plan.decode_weight_bytes_batch),
             f"the experts {plan.concurrency} tokens reach in expectation (uniform routing): "
             f"{1e12 / plan.decode_weight_bytes_batch:,.0f} steps/s per TB/s"),
        ]
    weights = "" if plan.quantization == "none" else f", {plan.quantization} weights"
    weights += f", {kv_dtype} KV cache" if kv_dtype != dtype else ""
    per_gpu = f", tensor-parallel over {tp} GPUs (sizes per GPU)" if tp > 1 else ""
    lines = [(f"model    {target.name}: {cfg.model_type}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
              f"{cfg.num_heads} heads / {cfg.num_kv_heads} KV heads"),
             (f"plan     {dtype}{weights}, context {plan.max_model_len:,} tokens, "
              f"{plan.concurrency} concurrent{per_gpu}; sizes in decimal GB (1 GB = 10^9 bytes)"),
             ""]
    width = max(len(r[0]) for r in rows)
    lines += [f"{label:<{width}}  {size:>12}  {note}".rstrip() for label, size, note in rows]
    if plan.memory_bytes is not None:
        where = f"{_gb(plan.memory_bytes)}" + (" per GPU" if tp > 1 else "")
        lines += ["", (f"fits in {where}: {plan.max_concurrency} concurrent requests of "
                       f"{plan.max_model_len:,} tokens (after weights, activations and the KV margin)")]
    if plan.memory_bytes is not None:
        lines.append(f"smallest tensor_parallel_size for {requests} in {_gb(plan.memory_bytes)} GPUs: "
                     + (str(smallest) if smallest is not None else
                        f"none up to {cfg.num_heads} (the model's query heads)"))
    cpu = cpu_report()
    lines += ["", (f"this CPU: ISA {cpu['cpu_isa']}, bfloat16 on BF16 units: {'yes' if cpu['has_bf16_units'] else 'no'}; "
                   f"dtype auto runs {cpu['auto_dtype']} on it")]
    return "\n".join(lines)


def _kv_dtype_bytes(plan: CapacityPlan) -> int:
    return torch.empty((), dtype=plan.kv_dtype or plan.dtype).element_size()
