"""Build the model for an EngineConfig: resolve the source, read config and weights, cast, quantize."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from batchgen.engine.attention import ATTENTION_BACKENDS
from batchgen.engine.capabilities import Capabilities, detect_capabilities
from batchgen.engine.config import EngineConfig
from batchgen.engine.loader.gguf_loader import iter_gguf_weights, read_gguf_config
from batchgen.engine.loader.hf_loader import iter_hf_weights, read_hf_config
from batchgen.engine.loader.source import ModelSource, resolve_model
from batchgen.engine.models.config import ModelConfig
from batchgen.engine.models.cpu_linear import pack_linears
from batchgen.engine.models.llama import LlamaForCausalLM
from batchgen.engine.models.rotary import RotaryEmbedding

log = logging.getLogger("batchgen.engine")


@dataclass
class LoadedModel:
    source: ModelSource | None  # None: built by the caller (build_loaded_model), no tokenizer
    model_cfg: ModelConfig
    model: LlamaForCausalLM
    max_model_len: int
    weight_bytes: int
    capabilities: Capabilities  # what runs here, decided once before the model was built


def read_model_config(source: ModelSource) -> ModelConfig:
    return read_gguf_config(source.folder / source.gguf_file) if source.is_gguf else read_hf_config(source.folder)


def unique_storage_bytes(module: torch.nn.Module) -> int:
    """Bytes of the distinct storages behind parameters and buffers (tied weights counted once)."""
    seen: dict[int, int] = {}
    for t in list(module.parameters()) + list(module.buffers()):
        if t.layout == torch._mkldnn:  # opaque oneDNN tensor (packed weight): no storage to look at
            seen[id(t)] = t.numel() * t.element_size()
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def model_weight_bytes(model: torch.nn.Module) -> int:
    """The weights a model holds: unique tensor storage, less the computed rotary tables."""
    return unique_storage_bytes(model) - unique_storage_bytes(model.rotary)


def build_empty_model(model_cfg: ModelConfig, max_positions: int, backend, device: torch.device,
                      dtype: torch.dtype) -> LlamaForCausalLM:
    """The model's modules with uninitialized parameters allocated once, directly in `dtype` on `device`.

    Built on the meta device with `dtype` as the default, then given storage: no float32 copy of the
    weights ever exists (an 8B model would need 32 GB for one). The rotary tables are left empty here;
    the caller computes them (they are float32 buffers, not weights).
    """
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(model_cfg, max_positions, backend)
    finally:
        torch.set_default_dtype(previous)
    model = model.to_empty(device=device)
    model.tie_weights()
    return model


def load_model(config: EngineConfig) -> LoadedModel:
    source = resolve_model(config.model)
    model_cfg = read_model_config(source)
    max_model_len = config.max_model_len or model_cfg.max_position_embeddings
    device, dtype = config.torch_device, config.torch_dtype
    is_fp8_checkpoint = False
    if not source.is_gguf:
        from batchgen.engine.quant.fp8_checkpoint import read_fp8_quant_config

        # FP8 checkpoints (refused: other methods, block-wise scales) load as stored, never re-quantized.
        is_fp8_checkpoint = read_fp8_quant_config(source.folder) is not None
    capabilities = detect_capabilities(config, model_cfg,
                                       has_fp8_layers=config.quantization == "fp8" or is_fp8_checkpoint)
    backend = ATTENTION_BACKENDS[capabilities.attention_backend](model_cfg.num_heads, model_cfg.num_kv_heads,
                                                                 model_cfg.head_dim)
    model = build_empty_model(model_cfg, max_model_len, backend, device, dtype)
    if source.is_gguf:
        weights = iter_gguf_weights(source.folder / source.gguf_file, model_cfg)
    else:
        from batchgen.engine.quant.fp8_checkpoint import prepare_fp8_checkpoint

        prepare_fp8_checkpoint(model, source.folder)
        weights = iter_hf_weights(source.folder)
    model.load_weights(weights)
    # Rotary tables are computed, not loaded (they were left empty on the meta device).
    model.rotary = RotaryEmbedding(model_cfg.head_dim, max_model_len, model_cfg.rope_theta,
                                   model_cfg.rope_scaling).to(device)
    model.eval()
    if capabilities.elementwise_ops == "compiled":
        model.enable_compile()
    elif capabilities.elementwise_ops == "c":
        model.enable_cpu_kernels()
    if capabilities.fp8_mode is not None:
        from batchgen.engine.quant.fp8 import quantize_model_fp8

        quantize_model_fp8(model, config, source, capabilities)
    if capabilities.is_onednn_packed_linear:  # after FP8, which leaves only the layers it did not quantize
        log.info("packed %d linear layers for oneDNN", pack_linears(model, capabilities.is_onednn_silu_mul))
    weight_bytes = model_weight_bytes(model)
    log.info("loaded %s (%s, %d layers) as %s on %s", source.display_name, model_cfg.model_type,
             model_cfg.num_layers, dtype, device)
    return LoadedModel(source, model_cfg, model, max_model_len, weight_bytes, capabilities)


def build_loaded_model(config: EngineConfig, model_cfg: ModelConfig, max_model_len: int,
                       fill_weights) -> LoadedModel:
    """A LoadedModel from weights the caller has: `fill_weights(model)` fills the empty model in place
    (e.g. `model.load_weights(hf_state_dict.items())`, or a seeded random init). Then the rotary tables,
    the elementwise kernels, FP8 (config.quantization) and oneDNN packing as load_model does. No
    source: an engine built on it has no tokenizer (prompts as token ids)."""
    capabilities = detect_capabilities(config, model_cfg, has_fp8_layers=config.quantization == "fp8")
    backend = ATTENTION_BACKENDS[capabilities.attention_backend](model_cfg.num_heads, model_cfg.num_kv_heads,
                                                                 model_cfg.head_dim)
    device = config.torch_device
    model = build_empty_model(model_cfg, max_model_len, backend, device, config.torch_dtype)
    with torch.no_grad():
        fill_weights(model)
    model.rotary = RotaryEmbedding(model_cfg.head_dim, max_model_len, model_cfg.rope_theta,
                                   model_cfg.rope_scaling).to(device)
    model.eval()
    if capabilities.elementwise_ops == "compiled":
        model.enable_compile()
    elif capabilities.elementwise_ops == "c":
        model.enable_cpu_kernels()
    if capabilities.fp8_mode is not None:
        from batchgen.engine.quant.fp8 import quantize_model_fp8

        quantize_model_fp8(model, config, None, capabilities)
    if capabilities.is_onednn_packed_linear:
        pack_linears(model, capabilities.is_onednn_silu_mul)
    return LoadedModel(None, model_cfg, model, max_model_len, model_weight_bytes(model), capabilities)
