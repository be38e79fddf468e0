"""Reading a PEFT LoRA adapter as published (adapter_config.json + adapter_model.safetensors) into the
engine's module layout.

PEFT saves one pair per targeted HF module, `...layers.N.self_attn.q_proj.lora_A.weight` (r, in) and
`...lora_B.weight` (out, r), and applies `y += scale * (x A^T) B^T` with scale = lora_alpha / r, or
lora_alpha / sqrt(r) with rsLoRA. The engine fuses q/k/v into qkv_proj and gate/up into gate_up_proj
(models/layers/decoder.py `_FUSED`), so an adapter's parts of one fused module become one pair here:
A (in, R) holds the parts' A matrices side by side (R = the sum of their ranks) and B (R, out) is
block-diagonal, each part's rows writing only its own output rows, with the scale folded in. A fused
module's delta is then one shrink (x A) and one expand (x B) whichever of its parts the adapter targets.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from batchgen.engine.lora.request import LoRARequest

# The engine's modules an adapter may target (HF names: q/k/v/o_proj, gate/up/down_proj, or the fused
# qkv_proj / gate_up_proj of checkpoints that store them fused).
SUPPORTED_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
SUPPORTED_HF_NAMES = "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (qkv_proj, gate_up_proj)"
_PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class LoRAError(ValueError):
    """An adapter that cannot be used with this model: the message names the adapter and the key."""


@dataclass
class LoRAAdapter:
    """One adapter in the engine's layout: module name (e.g. `layers.3.self_attn.qkv_proj`) ->
    (A (in, R), B (R, out)) float32, B scaled. `rank` is the largest rank of any HF module it targets."""

    name: str
    lora_int_id: int
    path: str
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    rank: int

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def resolve_adapter_folder(request: LoRARequest) -> Path:
    """The adapter's local folder: `lora_path` itself, or a Hugging Face repo id in the local cache
    (downloaded only where the Hub may be reached and HF_HUB_OFFLINE is unset)."""
    from batchgen.engine.loader.source import hub_cache_dir, is_hub_offline, is_repo_id

    path = Path(request.lora_path).expanduser()
    if path.is_dir():
        return path
    if not is_repo_id(request.lora_path):
        raise LoRAError(f"LoRA adapter {request.lora_name!r}: lora_path {request.lora_path!r} is not a folder")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(request.lora_path, cache_dir=hub_cache_dir(),
                                      local_files_only=is_hub_offline(),
                                      allow_patterns=[ADAPTER_CONFIG, ADAPTER_WEIGHTS]))
    except Exception as exc:  # noqa: BLE001 (not cached, offline, missing repo: all end the same way)
        raise LoRAError(f"LoRA adapter {request.lora_name!r}: {request.lora_path!r} is not a local folder nor "
                        f"in the Hugging Face cache {hub_cache_dir()}: {type(exc).__name__}: {exc}") from None


def read_adapter_config(request: LoRARequest, folder: Path) -> dict:
    where = f"LoRA adapter {request.lora_name!r} ({folder / ADAPTER_CONFIG})"
    try:
        config = json.loads((folder / ADAPTER_CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise LoRAError(f"{where}: cannot read it: {exc}") from None
    refusals = [
        ("peft_type", config.get("peft_type", "LORA") != "LORA", "must be LORA"),
        ("use_dora", bool(config.get("use_dora")), "DoRA adapters are not supported"),
        ("bias", config.get("bias", "none") != "none", "must be none (adapters that train biases are not supported)"),
        ("lora_bias", bool(config.get("lora_bias")), "must be false (lora_B biases are not supported)"),
        ("modules_to_save", bool(config.get("modules_to_save")), "must be empty (fully trained modules are "
                                                                 "not supported, only LoRA pairs)"),
        ("target_parameters", bool(config.get("target_parameters")), "must be empty"),
        ("layer_replication", bool(config.get("layer_replication")), "must be empty"),
    ]
    for key, is_refused, rule in refusals:
        if is_refused:
            raise LoRAError(f"{where}: {key} {rule}; got {config.get(key)!r}")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise LoRAError(f"{where}: {key} must be a positive number; got {value!r}")
    return config


def _pattern_value(patterns: dict, module_name: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key that matches the module name's end."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module_name):
            return value
    return default


def read_peft_adapter(request: LoRARequest, model: nn.Module, max_lora_rank: int,
                      base_model_name: str | None = None) -> LoRAAdapter:
    """The adapter `request` names, checked against `model` (a CausalLM: its module names and shapes)
    and `max_lora_rank`. LoRAError naming the adapter and the key for a target outside
    SUPPORTED_HF_NAMES, a rank over max_lora_rank, or a shape that is not this model's.
    `base_model_name`: the engine's model as the user named it, only for the messages."""
    from safetensors.torch import load_file

    from batchgen.engine.loader.safetensors_header import check_safetensors_header

    folder = resolve_adapter_folder(request)
    config = read_adapter_config(request, folder)
    where = f"LoRA adapter {request.lora_name!r} ({folder})"
    weights_path = folder / ADAPTER_WEIGHTS
    if not weights_path.is_file():
        raise LoRAError(f"{where}: no {ADAPTER_WEIGHTS} (only safetensors adapters are read, never pickles)")
    check_safetensors_header(weights_path)
    tensors = load_file(str(weights_path))
    pairs: dict[str, dict[str, torch.Tensor]] = {}  # HF module name -> {"A": .., "B": ..}
    for key, tensor in tensors.items():
        match = re.fullmatch(r"(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", key)
        if match is None:
            raise LoRAError(f"{where}: tensor {key!r} is not a LoRA pair's weight (lora_A / lora_B); "
                            f"embeddings, DoRA magnitudes and saved modules are not supported")
        module_name = match.group(1).removeprefix(_PEFT_PREFIX)
        pairs.setdefault(module_name, {})[match.group(2)] = tensor
    if not pairs:
        raise LoRAError(f"{where}: {ADAPTER_WEIGHTS} holds no LoRA weights")
    base_note = f" (trained on {config.get('base_model_name_or_path')!r}, loaded over {base_model_name!r})" \
        if base_model_name and config.get("base_model_name_or_path") else ""
    modules = dict(model.named_modules())
    fused_sizes = model.fused_part_sizes()
    parts: dict[str, dict[int | None, tuple[torch.Tensor, torch.Tensor, float]]] = {}
    max_rank = 0
    for module_name, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise LoRAError(f"{where}: module {module_name!r} has lora_{''.join(pair)} without its other half")
        target, part_index = model.checkpoint_target(module_name + ".weight")
        target_module = target.removesuffix(".weight")
        leaf = target_module.split(".")[-1]
        if leaf not in SUPPORTED_MODULES or target_module not in modules:
            raise LoRAError(f"{where}: key {module_name!r} targets a module LoRA cannot run on here; supported "
                            f"targets are {SUPPORTED_HF_NAMES} of the decoder layers{base_note}")
        a, b = pair["A"].float(), pair["B"].float()  # (r, in), (out, r)
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != rank:
            raise LoRAError(f"{where}: key {module_name!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                            "are not a LoRA pair")
        if rank > max_lora_rank:
            raise LoRAError(f"{where}: key {module_name!r} has rank {rank}, over max_lora_rank {max_lora_rank}: "
                            "raise engine.max_lora_rank (--max-lora-rank)")
        declared_rank = _pattern_value(config.get("rank_pattern"), module_name, config["r"])
        if rank != declared_rank:
            raise LoRAError(f"{where}: key {module_name!r} has rank {rank}, but adapter_config.json declares "
                            f"r = {declared_rank}")
        layer = modules[target_module]
        in_features = layer.in_features
        out_features = layer.out_features if part_index is None else fused_sizes[leaf][part_index]
        if a.shape[1] != in_features or b.shape[0] != out_features:
            raise LoRAError(f"{where}: key {module_name!r} has shapes A {tuple(a.shape)}, B {tuple(b.shape)}; this "
                            f"model's module takes {in_features} inputs to {out_features} outputs: the adapter "
                            f"was made for another base model{base_note}")
        alpha = _pattern_value(config.get("alpha_pattern"), module_name, config["lora_alpha"])
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        parts.setdefault(target_module, {})[part_index] = (a, b, scale)
        max_rank = max(max_rank, rank)
    weights = {}
    for target_module, by_part in parts.items():
        layer = modules[target_module]
        leaf = target_module.split(".")[-1]
        sizes = [layer.out_features] if None in by_part else fused_sizes[leaf]
        weights[target_module] = _fuse_parts(by_part, layer.in_features, sizes)
    return LoRAAdapter(request.lora_name, request.lora_int_id, str(folder), weights, max_rank)


def _fuse_parts(by_part: dict[int | None, tuple[torch.Tensor, torch.Tensor, float]], in_features: int,
                sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One module's (A (in, R), B (R, out)): the parts' A^T side by side, their scaled B^T block-diagonal
    (each part's rows reach only its own output rows of the fused module)."""
    total_rank = sum(a.shape[0] for a, _, _ in by_part.values())
    fused_a = torch.zeros(in_features, total_rank)
    fused_b = torch.zeros(total_rank, sum(sizes))
    row = 0
    for part_index, (a, b, scale) in sorted(by_part.items(), key=lambda item: item[0] or 0):
        rank = a.shape[0]
        start = sum(sizes[:part_index]) if part_index is not None else 0
        fused_a[:, row:row + rank] = a.t()
        fused_b[row:row + rank, start:start + b.shape[0]] = b.t() * scale
        row += rank
    return fused_a, fused_b
