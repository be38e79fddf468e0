"""Reading FP8 checkpoints (AutoFP8 / llm-compressor layouts) without re-quantizing.

Format: config.json `quantization_config` with `quant_method: "fp8"` (AutoFP8, vLLM's "fp8") or
`"compressed-tensors"` with 8-bit float weights (llm-compressor); per quantized linear layer the
tensors `<layer>.weight` (float8_e4m3fn, (N, K)), `<layer>.weight_scale` (one value per tensor, or
(N,) / (N, 1) per output channel) and optionally `<layer>.input_scale` (a static activation scale).

Before the weights stream in, the layers the checkpoint stores in FP8 become empty Fp8Linear modules;
the model's loader copies each FP8 weight in as is and `placing_fp8_scales` hands the scales to
`load_fp8_scale`. Fused layers (q/k/v, gate/up) get one scale row per output channel: a part's
per-tensor scale fills its rows, which represents every part exactly.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from batchgen.engine.quant.fp8_linear import Fp8Linear
from batchgen.engine.quant.weight_report import checkpoint_linear

log = logging.getLogger("batchgen.engine")

# Scales for an FP8 KV cache (llm-compressor's `self_attn.k_scale` / `v_scale`, AutoFP8's
# `k_proj.output_scale` / `v_proj.output_scale`): kept on the model as `kv_cache_scales`
# ({layer: {"k": .., "v": ..}}); an engine with kv_cache_dtype fp8 uses them (engine/attention/kv_cache.py).
KV_CACHE_SCALES = ("output_scale", "k_scale", "v_scale")
# Checkpoint tensors that are scales (of Fp8Linear layers, and the KV cache's), not weights.
FP8_SCALE_SUFFIXES = (".weight_scale", ".input_scale", ".output_scale", ".k_scale", ".v_scale")
_BLOCKWISE_HINT = ("block-wise FP8 checkpoints ({what}) are not supported yet; use a per-tensor or "
                   "per-channel FP8 checkpoint, or the unquantized checkpoint with quantization: fp8")


def read_fp8_quant_config(folder: Path) -> dict | None:
    """The checkpoint's quantization_config when it is a supported FP8 one; None when unquantized.

    Raises ValueError for other methods and for block-wise or group-wise FP8 scales.
    """
    from batchgen.engine.loader.hf_loader import read_hf_config_dict

    return fp8_quant_config(read_hf_config_dict(folder), str(folder))


def fp8_quant_config(hf_config: dict, where: str) -> dict | None:
    """`read_fp8_quant_config` on a config.json already read (`where` names it in errors).

    The one FP8-checkpoint detection: the loader and `batchgen plan` (local or remote config) use it.
    """
    qcfg = hf_config.get("quantization_config")
    if not qcfg:
        return None
    method = qcfg.get("quant_method")
    if method == "fp8":
        if qcfg.get("weight_block_size"):
            raise ValueError(f"{where}: " + _BLOCKWISE_HINT.format(
                what=f"weight_block_size {qcfg['weight_block_size']}"))
        return qcfg
    if method == "compressed-tensors":
        _check_compressed_tensors(where, qcfg)
        return qcfg
    raise ValueError(f"{where}: quantization_config.quant_method {method!r} is not supported "
                     "(only fp8 checkpoints: quant_method fp8, or compressed-tensors with 8-bit float weights)")


def _check_compressed_tensors(where: str, qcfg: dict) -> None:
    groups = qcfg.get("config_groups") or {}
    if not groups:
        raise ValueError(f"{where}: compressed-tensors quantization_config has no config_groups")
    for name, group in groups.items():
        weights = group.get("weights") or {}
        if (weights.get("num_bits"), weights.get("type")) != (8, "float"):
            raise ValueError(f"{where}: compressed-tensors group {name!r} is not FP8 ({weights}); "
                             "only FP8 weights with per-tensor or per-channel scales are supported")
        if weights.get("strategy") in ("block", "group"):
            raise ValueError(f"{where}: " + _BLOCKWISE_HINT.format(
                what=f"compressed-tensors strategy {weights['strategy']!r} in {name}"))
        if weights.get("strategy") not in ("tensor", "channel"):
            raise ValueError(f"{where}: compressed-tensors group {name!r} has FP8 scale strategy "
                             f"{weights.get('strategy')!r}; only tensor and channel are supported")


def prepare_fp8_checkpoint(model: nn.Module, folder: Path) -> bool:
    """If `folder` is an FP8 checkpoint, turn the layers it stores in FP8 into empty Fp8Linear modules.

    Returns whether it is one. Refuses block-wise checkpoints (their `weight_scale_inv` tensors).
    """
    from safetensors import safe_open

    from batchgen.engine.loader.hf_loader import safetensors_files

    if read_fp8_quant_config(folder) is None:
        return False
    names: list[str] = []
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as f:
            names.extend(f.keys())
    if any(n.endswith("weight_scale_inv") for n in names):
        raise ValueError(f"{folder}: " + _BLOCKWISE_HINT.format(what="weight_scale_inv tensors"))
    fused = getattr(model, "_FUSED", {})
    layers = set()
    for name in names:
        if name.endswith(".weight_scale"):
            parts = name.removeprefix("model.").removesuffix(".weight_scale").split(".")
            layers.add(".".join(fused[p][0] if p in fused else p for p in parts))
    for name in sorted(layers):
        linear = checkpoint_linear(model, name, folder, "FP8 layer")
        w = linear.weight
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child,
                Fp8Linear(linear.in_features, linear.out_features, linear.bias is not None,
                          dtype=w.dtype, device=w.device))
    return True


def placing_fp8_scales(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights` (HF-named checkpoint tensors) less the FP8 scales, each placed as it passes by
    `load_fp8_scale` at the model's name for it (`model.checkpoint_target`: q/k/v and gate/up fused);
    the model's load_weights takes the rest."""
    part_sizes = model.fused_part_sizes()
    for name, tensor in weights:
        if name.endswith(FP8_SCALE_SUFFIXES):
            target, part_index = model.checkpoint_target(name)
            load_fp8_scale(model, target, tensor, part_index, part_sizes.get(target.split(".")[-2]))
            continue
        yield name, tensor


@torch.no_grad()
def load_fp8_scale(model: nn.Module, target: str, tensor: torch.Tensor, part_index: int | None,
                   part_sizes: list[int] | None) -> None:
    """Place a checkpoint's `<layer>.weight_scale` / `.input_scale` (target uses the model's fused names).

    part_index / part_sizes locate q/k/v or gate/up inside a fused layer (None for unfused layers).
    """
    module_name, kind = target.rsplit(".", 1)
    if kind in KV_CACHE_SCALES:
        _record_kv_cache_scale(model, target, kind, tensor, part_index)
        return
    module = model.get_submodule(module_name)
    if not isinstance(module, Fp8Linear):
        raise ValueError(f"checkpoint tensor {target!r} belongs to {module_name!r}, which is not an FP8 layer")
    value = tensor.detach().float().reshape(-1).to(module.weight.device)
    if kind == "input_scale":
        if value.numel() != 1:
            raise ValueError(f"{target}: only per-tensor static input scales are supported, got {value.numel()} values")
        # Fused parts share one input; the largest calibrated scale keeps every part's range within 448.
        value = value.reshape(())
        module.input_scale = value if module.input_scale is None else torch.maximum(module.input_scale, value)
        return
    if part_index is None and value.numel() == 1:
        module.weight_scale = value  # (1,) per-tensor layout, kept as stored
        return
    offset = sum(part_sizes[:part_index]) if part_index is not None else 0
    size = part_sizes[part_index] if part_index is not None else module.out_features
    if value.numel() not in (1, size):
        raise ValueError(f"{target}: weight_scale has {value.numel()} values; expected 1 or {size}")
    if module.weight_scale.numel() != module.out_features:  # a fused layer always holds one row per channel
        module.weight_scale = torch.full((module.out_features,), float("nan"), device=value.device)
    module.weight_scale[offset:offset + size] = value  # a per-tensor value broadcasts over its part's rows


def _record_kv_cache_scale(model: nn.Module, target: str, kind: str, tensor: torch.Tensor,
                           part_index: int | None) -> None:
    """A layer's FP8 KV-cache scale into model.kv_cache_scales (one value: the cache holds x / scale)."""
    if kind == "output_scale":  # on the fused qkv: k_proj's (part 1) and v_proj's (part 2) count
        which = {1: "k", 2: "v"}.get(part_index)
        if which is None:
            return
    else:
        which = kind[0]
    parts = target.split(".")
    if "layers" not in parts or tensor.numel() != 1:
        raise ValueError(f"checkpoint tensor {target!r}: expected one KV-cache scale per decoder layer")
    layer = int(parts[parts.index("layers") + 1])
    scales = getattr(model, "kv_cache_scales", None)
    if scales is None:
        scales = model.kv_cache_scales = {}
    scales.setdefault(layer, {})[which] = float(tensor.float().reshape(()))
    _note_kv_cache_scales_read()


@functools.lru_cache(maxsize=1)
def _note_kv_cache_scales_read() -> None:
    log.info("fp8: the checkpoint has KV-cache scales; an FP8 KV cache (engine.kv_cache_dtype) uses them")


def check_fp8_scales_loaded(model: nn.Module) -> None:
    """Every Fp8Linear must have had all its weight scales set by the checkpoint."""
    for name, module in model.named_modules():
        if isinstance(module, Fp8Linear) and torch.isnan(module.weight_scale).any():
            raise ValueError(f"the FP8 checkpoint is missing weight_scale for (part of) {name}")
