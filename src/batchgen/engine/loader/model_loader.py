"""Build the model for an EngineConfig: resolve the source, read config and weights, cast, quantize.

The weight format is decided once, before the model is built (engine/quant/methods.py): integer
checkpoints and kept GGUF blocks become IntLinear layers before the float tensors stream in;
fp8 / int8 / int4 at load swap the float layers after.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from batchgen.engine.attention import ATTENTION_BACKENDS
from batchgen.engine.capabilities import Capabilities, detect_capabilities
from batchgen.engine.config import EngineConfig
from batchgen.engine.loader.finite_weights import check_int_weights_finite, finite_weights
from batchgen.engine.loader.gguf_loader import iter_gguf_weights, read_gguf_config
from batchgen.engine.loader.hf_loader import iter_hf_weights, read_hf_config
from batchgen.engine.loader.source import ModelSource, resolve_model
from batchgen.engine.models.bf16_linear import widen_bf16_model
from batchgen.engine.models.config import ModelConfig
from batchgen.engine.models.cpu_linear import pack_linears
from batchgen.engine.models.layers.causal_lm import CausalLM
from batchgen.engine.models.registry import model_class
from batchgen.engine.quant.fp8_checkpoint import placing_fp8_scales
from batchgen.engine.quant.weight_report import unique_storage_bytes, weight_report

if TYPE_CHECKING:
    from batchgen.engine.parallel import TensorParallel

log = logging.getLogger("batchgen.engine")

# Attention backends whose per-step metadata come from the packed step alone (what a worker receives).
PARALLEL_ATTENTION_BACKENDS = ("cpu", "triton")


@dataclass
class LoadedModel:
    source: ModelSource | None  # None: built by the caller (build_loaded_model), no tokenizer
    model_cfg: ModelConfig
    model: CausalLM
    max_model_len: int
    weight_bytes: int
    capabilities: Capabilities  # what runs here, decided once before the model was built
    weights: dict = field(default_factory=dict)  # the weight format and linear bytes (weight_report)
    tokenizer: object | None = None  # the source's Tokenizer when loading already read it (calibration)
    # EngineConfig.merged_lora that could not be merged (it targets layers quantized in the checkpoint):
    # its rank, for the LoRA layers that run it on every request; 0: merged, or no merged_lora.
    unmerged_lora_rank: int = 0


def read_model_config(source: ModelSource) -> ModelConfig:
    return read_gguf_config(source.folder / source.gguf_file) if source.is_gguf else read_hf_config(source.folder)


def model_weight_bytes(model: torch.nn.Module) -> int:
    """The weights a model holds: unique tensor storage, less the computed rotary tables."""
    return unique_storage_bytes(model) - unique_storage_bytes(model.rotary)


def build_empty_model(model_cfg: ModelConfig, max_positions: int, backend, device: torch.device,
                      dtype: torch.dtype, parallel: TensorParallel | None = None) -> CausalLM:
    """The model's modules (the class the registry names for model_cfg's architecture) with
    uninitialized parameters allocated once, directly in `dtype` on `device`.

    Built on the meta device with `dtype` as the default, then given storage: no float32 copy of the
    weights ever exists (an 8B model would need 32 GB for one). The rotary tables are left empty here;
    the caller computes them (they are float32 buffers, not weights). With `parallel`, `model_cfg` is
    the rank's (layout.rank_config): only the rank's shard is allocated.
    """
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = model_class(model_cfg)(model_cfg, max_positions, backend, parallel)
    finally:
        torch.set_default_dtype(previous)
    _allocate(model, device)
    model.tie_weights()
    return model


def _allocate(model: torch.nn.Module, device: torch.device) -> None:
    """Give every meta parameter and buffer uninitialized storage on `device` (tied tensors stay tied).
    What Module.to_empty does, through torch.empty: to_empty's empty_like on meta tensors goes through
    torch._refs, whose first use imports torch._dynamo (seconds of every process's load)."""
    made: dict[int, torch.Tensor] = {}

    def empty(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            made[id(t)] = torch.empty(t.shape, dtype=t.dtype, device=device)
        return made[id(t)]

    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                module._parameters[name] = torch.nn.Parameter(empty(param), requires_grad=param.requires_grad)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = empty(buffer)


def read_declared_quantization(source: ModelSource):
    """The folder's DeclaredQuantization (None for GGUF files and unquantized folders)."""
    from batchgen.engine.loader.hf_loader import read_hf_config_dict
    from batchgen.engine.quant.methods import declared_quantization

    if source.is_gguf:
        return None
    return declared_quantization(read_hf_config_dict(source.folder), str(source.folder))


def _float_weights(source: ModelSource, shard):
    """An HF folder's tensors (this rank's slices under tensor parallelism); a block-scaled FP8
    checkpoint's dequantized as they stream in (quant/fp8_block.py), each read whole and then cut (a
    rank's slice need not fall on block edges)."""
    from batchgen.engine.loader.hf_loader import read_hf_config_dict
    from batchgen.engine.parallel.shards import shard_tensors
    from batchgen.engine.quant.fp8_block import dequantizing_fp8_blocks, fp8_block_size

    block_size = fp8_block_size(read_hf_config_dict(source.folder), source.display_name)
    if block_size is None:
        return iter_hf_weights(source.folder, shard)
    log.info("fp8: %s holds FP8 weights in %d x %d blocks; dequantized at load", source.display_name, *block_size)
    weights = dequantizing_fp8_blocks(iter_hf_weights(source.folder), block_size, source.display_name)
    return weights if shard is None else shard_tensors(weights, shard)


def resolve_weight_format(config: EngineConfig, source: ModelSource):
    """(format name, DeclaredQuantization or None): what config.quantization loads for this source."""
    from batchgen.engine.quant.methods import resolve_quantization

    declared = read_declared_quantization(source)
    name = resolve_quantization(config.quantization, declared, is_gguf=source.is_gguf, where=source.display_name)
    return name, declared


def load_model(config: EngineConfig, parallel: TensorParallel | None = None) -> LoadedModel:
    """The model `config` names, loaded and quantized as it says. `parallel` (tensor parallelism):
    this rank's shard only (every rank calls this at once; quantizing at load then runs on each
    rank's shard, the calibration forward passes in step across the ranks)."""
    from batchgen.engine.quant.methods import INT_CHECKPOINTS

    source = resolve_model(config.model, config.revision)
    model_cfg = read_model_config(source)
    max_model_len = config.max_model_len or model_cfg.max_position_embeddings
    device, dtype = config.torch_device, config.torch_dtype
    weight_format, declared = resolve_weight_format(config, source)
    capabilities = detect_capabilities(config, model_cfg, has_fp8_layers=weight_format == "fp8",
                                       has_float_weights=weight_format == "none")
    shard = None
    rank_cfg = model_cfg  # the shapes this process's modules have
    if parallel is not None:
        check_can_run_parallel(capabilities, parallel)
        rank_cfg, shard = parallel.layout.rank_config(model_cfg), parallel.layout.shard
    backend = ATTENTION_BACKENDS[capabilities.attention_backend](rank_cfg.num_heads, rank_cfg.num_kv_heads,
                                                                 rank_cfg.head_dim)
    model = build_empty_model(rank_cfg, max_model_len, backend, device, dtype, parallel)
    origin = "float"
    tokenizer = None
    if source.is_gguf:
        path = source.folder / source.gguf_file
        kept = {}
        if weight_format == "gguf":
            from batchgen.engine.loader.gguf_blocks import read_gguf_int_weights
            from batchgen.engine.loader.gguf_loader import hf_tensor_name, row_permutation
            from batchgen.engine.quant.int_checkpoint import install_int_layers

            kept = read_gguf_int_weights(path, lambda name: hf_tensor_name(name, rank_cfg),
                                         lambda base, rows: row_permutation(rank_cfg, base, rows), shard)
            check_int_weights_finite(kept, str(path))
            install_int_layers(model, {k.removeprefix("model."): w for k, w in kept.items()}, device, str(path))
            origin = "GGUF blocks"
        weights = iter_gguf_weights(path, rank_cfg, skip=frozenset(f"{k}.weight" for k in kept), shard=shard)
    elif weight_format in INT_CHECKPOINTS:
        from batchgen.engine.quant.int_checkpoint import install_int_layers, read_int_checkpoint, without

        int_weights, consumed = read_int_checkpoint(source.folder, declared, shard)
        check_int_weights_finite(int_weights, source.display_name)
        install_int_layers(model, int_weights, device, source.display_name)
        weights = without(iter_hf_weights(source.folder, shard), consumed, model)
        origin = "checkpoint"
    else:
        if weight_format == "fp8" and declared is not None:
            from batchgen.engine.quant.fp8_checkpoint import prepare_fp8_checkpoint

            prepare_fp8_checkpoint(model, source.folder)  # FP8 checkpoints load as stored, never re-quantized
        weights = _float_weights(source, shard)
    weights = finite_weights(weights, str(source.folder / source.gguf_file) if source.is_gguf else source.display_name)
    model.load_weights(placing_fp8_scales(model, weights))  # FP8 checkpoints' scales go to their layers
    # Before quantizing at load and packing: those layers are built from the merged float weights.
    unmerged_lora_rank = _merge_lora(model, config) if config.merged_lora else 0
    if parallel is not None:  # every rank's weights are in before any collective (calibration) runs
        parallel.group.rendezvous("weights", parallel.check_peers)
    _prepare_for_inference(model, max_model_len, capabilities, device)
    if capabilities.fp8_mode is not None:
        from batchgen.engine.quant.fp8 import quantize_model_fp8

        quantize_model_fp8(model, config, source, capabilities)
        origin = "checkpoint" if declared is not None else "at load"
    elif weight_format in ("int8", "int4"):
        from batchgen.engine.quant.int_model import quantize_model_int

        windows = None
        if config.int_calibration == "activation_aware":  # the bundled calibration text as the model's tokens
            from batchgen.engine.quant.calibrate.activation_aware import calibration_windows
            from batchgen.engine.text.tokenizer import Tokenizer

            tokenizer = Tokenizer(source)
            windows = calibration_windows(tokenizer, max_model_len, model_cfg.vocab_size)
        quantize_model_int(model, config, weight_format, windows)
        origin = "at load"
    if capabilities.is_onednn_packed_linear:  # after quantizing, which leaves only the layers it did not swap
        log.debug("packed %d linear layers for oneDNN", pack_linears(model, capabilities.is_onednn_silu_mul))
    elif capabilities.bf16_path == "widened":
        log.info("%d bfloat16 linear layers widened to float32 per call (no BF16 units here)", widen_bf16_model(model))
    weight_bytes = model_weight_bytes(model)
    weights_info = weight_report(model, weight_format, origin)
    where = "" if parallel is None else f" (rank {parallel.rank} of {parallel.world_size})"
    log.info("loaded %s (%s, %d layers) as %s on %s%s; weights %s (%s), linear layers %.1f MB (%.1f%% of float32)",
             source.display_name, model_cfg.model_type, model_cfg.num_layers, dtype, device, where, weight_format,
             origin, weights_info["linear_bytes"] / 1e6, 100 * weights_info["linear_bytes_vs_float32"])
    return LoadedModel(source, model_cfg, model, max_model_len, weight_bytes, capabilities, weights_info, tokenizer,
                       unmerged_lora_rank)


def _merge_lora(model: CausalLM, config: EngineConfig) -> int:
    """config.merged_lora added to the float weights (engine/lora/merge.py); when it targets a layer
    quantized in the checkpoint nothing is merged and its rank comes back (it then runs unmerged)."""
    from batchgen.engine.lora.merge import merge_adapter, read_merged_adapter, unmergeable_modules

    adapter = read_merged_adapter(config.merged_lora, model, config.model)
    quantized = unmergeable_modules(model, adapter)
    if quantized:
        log.info("merged_lora %s: %d targeted layers are quantized in the checkpoint (%s, ...); the adapter runs "
                 "unmerged on every request", config.merged_lora, len(quantized), quantized[0])
        return adapter.rank
    log.info("merged_lora %s: merged into %d layers", config.merged_lora, merge_adapter(model, adapter))
    return 0


def check_weights_finite(source: ModelSource) -> tuple[int, int]:
    """Read every tensor of `source` as the float loader would (a GGUF's blocks dequantized) and check
    each is finite, without building the model (`batchgen validate --weights`); returns (tensors, bytes
    read). Raises NonFiniteWeightError naming the file and the tensor."""
    if source.is_gguf:
        path = source.folder / source.gguf_file
        weights, where = iter_gguf_weights(path, read_gguf_config(path)), str(path)
    else:
        weights, where = iter_hf_weights(source.folder), source.display_name
    num_tensors = num_bytes = 0
    for _, tensor in finite_weights(weights, where):
        num_tensors += 1
        num_bytes += tensor.numel() * tensor.element_size()
    return num_tensors, num_bytes


def check_can_run_parallel(capabilities: Capabilities, parallel: TensorParallel) -> None:
    """Tensor parallelism needs an attention backend that keeps no per-sequence state (the workers
    see steps, not sequences): cpu or triton, not sdpa."""
    if capabilities.attention_backend not in PARALLEL_ATTENTION_BACKENDS:
        raise ValueError(
            f"tensor_parallel_size {parallel.world_size} needs attention_backend "
            f"{' or '.join(PARALLEL_ATTENTION_BACKENDS)}; this model would attend through "
            f"{capabilities.attention_backend} (its decode staging follows sequences that only rank 0 sees). "
            f"On the CPU that means the C kernels (float32 or bfloat16, head_dim a multiple of 16)")


def _prepare_for_inference(model: CausalLM, max_model_len: int, capabilities: Capabilities,
                           device: torch.device) -> None:
    """After the weights are in: the rotary tables (computed, not loaded: they were left empty on the
    meta device), eval mode and the elementwise ops the capabilities chose."""
    model.rotary = model.make_rotary(max_model_len).to(device)
    model.eval()
    if capabilities.elementwise_ops == "compiled":
        model.enable_compile()
    elif capabilities.elementwise_ops == "c":
        model.enable_cpu_kernels()


def build_loaded_model(config: EngineConfig, model_cfg: ModelConfig, max_model_len: int,
                       fill_weights) -> LoadedModel:
    """A LoadedModel from weights the caller has: `fill_weights(model)` fills the empty model in place
    (e.g. `model.load_weights(hf_state_dict.items())`, or a seeded random init). Then the rotary tables,
    the elementwise kernels, FP8 (config.quantization) and oneDNN packing as load_model does. No
    source: an engine built on it has no tokenizer (prompts as token ids)."""
    capabilities = detect_capabilities(config, model_cfg, has_fp8_layers=config.quantization == "fp8",
                                       has_float_weights=config.quantization in ("auto", "none"))
    backend = ATTENTION_BACKENDS[capabilities.attention_backend](model_cfg.num_heads, model_cfg.num_kv_heads,
                                                                 model_cfg.head_dim)
    device = config.torch_device
    model = build_empty_model(model_cfg, max_model_len, backend, device, config.torch_dtype)
    with torch.no_grad():
        fill_weights(model)
    _prepare_for_inference(model, max_model_len, capabilities, device)
    if capabilities.fp8_mode is not None:
        from batchgen.engine.quant.fp8 import quantize_model_fp8

        quantize_model_fp8(model, config, None, capabilities)
    if capabilities.is_onednn_packed_linear:
        pack_linears(model, capabilities.is_onednn_silu_mul)
    elif capabilities.bf16_path == "widened":
        widen_bf16_model(model)
    return LoadedModel(None, model_cfg, model, max_model_len, model_weight_bytes(model), capabilities)
