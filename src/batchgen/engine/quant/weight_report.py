"""What the loaded model's weights are: format, where they came from, and the decoder's linear bytes.

Reported by the engine's stats (`weights`) and the job's `_SUCCESS`; `linear_bytes` counts the
storage the decoder's linear layers hold (codes, scales, zeros, minima; biases excluded; shared tensors
once), `float32_linear_bytes` what the same layers would take as float32 weights.
"""

from __future__ import annotations

import torch
from torch import nn


def linear_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The decoder's linear layers (q/k/v, o, gate/up, down per layer), whatever class holds them."""
    return {name: module for name, module in model.named_modules()
            if name.startswith("layers.") and name.rsplit(".", 1)[-1] in ("qkv_proj", "o_proj", "gate_up_proj",
                                                                          "down_proj")}


def checkpoint_linear(model: nn.Module, name: str, where: str, what: str) -> nn.Linear:
    """The float nn.Linear at `name` that a checkpoint's quantized tensors (`what`) replace; ValueError
    naming the checkpoint (`where`) when the model has no such layer, or it is not a linear one."""
    try:
        linear = model.get_submodule(name)
    except AttributeError as exc:
        raise ValueError(f"{where}: {what} {name!r} has no place in the model") from exc
    if not isinstance(linear, nn.Linear):
        raise ValueError(f"{where}: {what} for {name!r}, which is not a linear layer")
    return linear


def unique_storage_bytes(module: nn.Module, exclude: tuple[torch.Tensor, ...] = ()) -> int:
    """Bytes of the distinct storages behind parameters and buffers (tied weights counted once),
    leaving out the tensors in `exclude` (e.g. a layer's bias)."""
    seen: dict[int, int] = {}
    for t in list(module.parameters()) + list(module.buffers()):
        if any(t is e for e in exclude):
            continue
        if t.layout == torch._mkldnn:  # opaque oneDNN tensor (packed weight): no storage to look at
            seen[id(t)] = t.numel() * t.element_size()
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def layer_weight_bytes(module: nn.Module) -> int:
    """Storage bytes of one linear layer's weight (tensors shared within the layer once), bias excluded."""
    bias = getattr(module, "bias", None)
    return unique_storage_bytes(module, exclude=() if bias is None else (bias,))


def weight_report(model: nn.Module, weight_format: str, origin: str) -> dict:
    """{format, origin, num_linear_layers, num_pre_quant_scaled_layers (activation-aware int8 / int4),
    num_hadamard_rotated_layers (activation-aware int4), linear_bytes, float32_linear_bytes, linear_bytes_vs_float32}."""
    layers = linear_layers(model)
    linear_bytes = sum(layer_weight_bytes(m) for m in layers.values())
    float32_bytes = sum(m.in_features * m.out_features * 4 for m in layers.values())
    num_scaled = sum(getattr(m, "pre_quant_scale", None) is not None for m in layers.values())
    num_rotated = sum(bool(getattr(m, "hadamard_size", 0)) for m in layers.values())
    return {"format": weight_format, "origin": origin, "num_linear_layers": len(layers),
            "num_pre_quant_scaled_layers": num_scaled, "num_hadamard_rotated_layers": num_rotated,
            "linear_bytes": linear_bytes, "float32_linear_bytes": float32_bytes,
            "linear_bytes_vs_float32": linear_bytes / float32_bytes if float32_bytes else 0.0}
