"""Integer checkpoints (GPTQ, AWQ, compressed-tensors) read as published, into IntLinear layers.

Before the float tensors stream into the model, `read_int_checkpoint` reads every quantized layer's
tensors (found by name: `<layer>.qweight/.qzeros/.scales/.g_idx` for GPTQ and AWQ,
`<layer>.weight_packed/.weight_scale/.weight_shape/.weight_zero_point/.weight_g_idx` for
compressed-tensors pack-quantized, `<layer>.weight` int8 + `.weight_scale` for int-quantized) into
IntWeights, and `install_int_layers` swaps the model's linear layers for IntLinear (q/k/v and
gate/up fused along the output dim, as the float model fuses them). What stays (embeddings, norms,
layers the checkpoint left in float) loads through the model's own load_weights.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from batchgen.engine.quant.int_formats import (
    IntWeight,
    read_awq,
    read_gptq,
    read_int_quantized,
    read_pack_quantized,
)
from batchgen.engine.quant.int_formats.int_weight import concat_out_features
from batchgen.engine.quant.int_linear import IntLinear
from batchgen.engine.quant.methods import DeclaredQuantization
from batchgen.engine.quant.weight_report import checkpoint_linear

if TYPE_CHECKING:
    from batchgen.engine.parallel.shards import ShardFn

log = logging.getLogger("batchgen.engine")

GPTQ_AWQ_TENSORS = ("qweight", "qzeros", "scales", "g_idx")
CT_PACKED_TENSORS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")


def read_int_checkpoint(folder: Path, declared: DeclaredQuantization,
                        shard: ShardFn | None = None) -> tuple[dict[str, IntWeight], set[str]]:
    """({HF layer name without "model.": IntWeight}, the tensor names consumed) for every quantized layer.

    Layers are read one at a time (their tensors, then the IntWeight). `shard` (tensor parallelism):
    each layer's IntWeight is cut to this rank's rows or group-aligned columns before the next is read.
    """
    from contextlib import ExitStack

    from safetensors import safe_open

    from batchgen.engine.loader.hf_loader import safetensors_files
    from batchgen.engine.parallel.shards import shard_int_weight

    layers: dict[str, dict[str, tuple[object, str]]] = {}  # prefix -> kind -> (open file, tensor name)
    consumed: set[str] = set()
    weights: dict[str, IntWeight] = {}
    with ExitStack() as files:
        for file in safetensors_files(folder):
            f = files.enter_context(safe_open(str(file), framework="pt"))
            names = list(f.keys())
            for name in names:
                prefix, _, kind = name.rpartition(".")
                if _is_quant_tensor(declared.method, kind, name, names, f):
                    layers.setdefault(prefix, {})[kind] = (f, name)
                    consumed.add(name)
        for prefix, where in layers.items():
            w = _to_int_weight(declared, prefix, {kind: f.get_tensor(name) for kind, (f, name) in where.items()},
                               folder)
            if shard is not None:
                w = shard_int_weight(w, shard(f"{prefix}.weight", (w.out_features, w.in_features)),
                                     f"{folder}: layer {prefix}")
            weights[prefix.removeprefix("model.")] = w
    return weights, consumed


def _is_quant_tensor(method: str, kind: str, name: str, names: list[str], f) -> bool:
    if method in ("gptq", "awq"):
        return kind in GPTQ_AWQ_TENSORS
    if kind in CT_PACKED_TENSORS:
        return True
    # int-quantized: the layer's `.weight` itself is int8, next to a `.weight_scale`.
    return kind == "weight" and name + "_scale" in names and f.get_slice(name).get_dtype() == "I8"


def _to_int_weight(declared: DeclaredQuantization, prefix: str, t: dict[str, torch.Tensor], folder: Path) -> IntWeight:
    cfg, where = declared.config, f"{folder}: layer {prefix}"
    try:
        if declared.method == "gptq":
            return read_gptq(t["qweight"], t["qzeros"], t["scales"], bits=declared.bits,
                             group_size=declared.group_size, g_idx=t.get("g_idx"),
                             checkpoint_format=cfg.get("checkpoint_format", "gptq"))
        if declared.method == "awq":
            return read_awq(t["qweight"], t["qzeros"], t["scales"], group_size=declared.group_size)
        group_size = declared.group_size if declared.group_size > 0 else None
        if "weight_packed" in t:
            return read_pack_quantized(t["weight_packed"], t["weight_scale"], t["weight_shape"].tolist(),
                                       bits=declared.bits, weight_zero_point=t.get("weight_zero_point"),
                                       weight_g_idx=t.get("weight_g_idx"), group_size=group_size)
        return read_int_quantized(t["weight"], t["weight_scale"], bits=declared.bits,
                                  weight_zero_point=t.get("weight_zero_point"), weight_g_idx=t.get("weight_g_idx"),
                                  group_size=group_size)
    except KeyError as exc:
        raise ValueError(f"{where} lacks its {exc.args[0]} tensor") from None
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


class IntLinearParts(nn.Module):
    """A fused layer (q/k/v, gate/up) whose parts cannot share one IntWeight layout (different
    act-order permutations or group sizes): each part multiplies on its own, outputs concatenated."""

    def __init__(self, parts: list[IntWeight], bias: torch.Tensor | None, device: torch.device):
        super().__init__()
        self.parts = nn.ModuleList(IntLinear(p, device=device) for p in parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(device), requires_grad=False)

    def num_weight_bytes(self) -> int:
        return sum(p.num_weight_bytes() for p in self.parts)

    def dequantized_weight(self) -> torch.Tensor:
        """(N, K) float32, the parts' weights stacked (IntLinear.dequantized_weight), bias left out."""
        return torch.cat([p.dequantized_weight() for p in self.parts])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([p(x) for p in self.parts], dim=-1)
        return y if self.bias is None else y + self.bias


def install_int_layers(model: nn.Module, weights: dict[str, IntWeight], device: torch.device,
                       where: str) -> int:
    """Replace the model's linear layers named (HF names) in `weights` by IntLinear; returns how many.

    The parts of a fused layer must all be quantized; a part's bias stays a float tensor that the
    model's load_weights fills in afterwards (the new layer keeps a bias parameter of the fused size).
    """
    fused_names: dict[str, tuple[str, int]] = getattr(model, "_FUSED", {})
    groups: dict[str, dict[int | None, IntWeight]] = {}
    for name, w in weights.items():
        parts = name.split(".")
        target, index = name, None
        for i, p in enumerate(parts):
            if p in fused_names:
                fused, index = fused_names[p]
                target = ".".join(parts[:i] + [fused] + parts[i + 1:])
                break
        groups.setdefault(target, {})[index] = w
    for target, parts in sorted(groups.items()):
        linear = checkpoint_linear(model, target, where, "quantized layer")
        expected = [None] if None in parts else list(range(_num_parts(model, target)))
        if sorted(parts, key=lambda i: -1 if i is None else i) != expected:
            raise ValueError(f"{where}: {target} is quantized in parts {sorted(p for p in parts if p is not None)} "
                             f"only; every part of a fused layer must be")
        ordered = [parts[i] for i in expected]
        out_features = sum(p.out_features for p in ordered)
        if (ordered[0].in_features, out_features) != (linear.in_features, linear.out_features):
            raise ValueError(f"{where}: quantized {target} is {out_features} x {ordered[0].in_features}, the model "
                             f"expects {linear.out_features} x {linear.in_features}")
        bias = None if linear.bias is None else torch.zeros(out_features, dtype=linear.bias.dtype)
        fused = concat_out_features(ordered)
        new = IntLinear(fused, bias, device=device) if fused is not None else IntLinearParts(ordered, bias, device)
        parent, _, child = target.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    return len(groups)


def _num_parts(model: nn.Module, target: str) -> int:
    fused = target.rsplit(".", 1)[-1]
    return sum(1 for f, _ in getattr(model, "_FUSED", {}).values() if f == fused) or 1


def without(weights, consumed: set[str], model: nn.Module):
    """The checkpoint's tensors less those read into IntWeights, and less the all-zero biases that GPTQ
    writers store for quantized layers of models that have none (AutoGPTQ saves one per QuantLinear)."""
    quantized = {name.rpartition(".")[0] for name in consumed}
    for name, tensor in weights:
        if name in consumed:
            continue
        prefix, _, kind = name.rpartition(".")
        if kind == "bias" and prefix in quantized and not _model_has_bias(model, prefix) and not tensor.any():
            continue
        yield name, tensor


def _model_has_bias(model: nn.Module, hf_prefix: str) -> bool:
    parts = hf_prefix.removeprefix("model.").split(".")
    fused = getattr(model, "_FUSED", {})
    name = ".".join(fused[p][0] if p in fused else p for p in parts)
    try:
        return getattr(model.get_submodule(name), "bias", None) is not None
    except AttributeError:
        return False
