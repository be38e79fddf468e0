"""One LoRA adapter merged into the base weights at load (EngineConfig.merged_lora): W += scale * B A,
as PEFT's `merge_and_unload` does, so every request runs the fine-tune at the base model's speed.

The merge runs on the float weights right after they are read, before the loader quantizes (FP8,
int8/int4 at load) or packs them for oneDNN: the packed and quantized layers are built from the merged
weights, and each load is the engine's own copy (an engine with another merged_lora never shares
weights: merged_lora is not a runtime setting). A layer already quantized in the checkpoint (GPTQ/AWQ,
compressed-tensors, an FP8 checkpoint, kept GGUF blocks) has no float weight to merge into: then nothing
is merged and the engine runs the adapter unmerged on every request (LoRA layers, as enable_lora does).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from batchgen.engine.lora.peft_adapter import LoRAAdapter, LoRAError, read_peft_adapter
from batchgen.engine.lora.request import LoRARequest

log = logging.getLogger("batchgen.engine")

# The id of the merged adapter when it has to run unmerged (its LoRARequest; any id >= 1 would do).
MERGED_LORA_ID = 1
# Large enough for any published adapter's rank: the merge takes every rank, its size limit is memory.
_MERGE_MAX_RANK = 1 << 16


def merged_lora_request(path: str) -> LoRARequest:
    """The LoRARequest of EngineConfig.merged_lora (named after its folder)."""
    return LoRARequest(path.rstrip("/").rsplit("/", 1)[-1] or path, MERGED_LORA_ID, path)


def read_merged_adapter(path: str, model: nn.Module, base_model_name: str | None) -> LoRAAdapter:
    """The adapter at `path` in the engine's layout (LoRAError naming it and the key when it cannot run
    over `model`)."""
    return read_peft_adapter(merged_lora_request(path), model, _MERGE_MAX_RANK, base_model_name)


def unmergeable_modules(model: nn.Module, adapter: LoRAAdapter) -> list[str]:
    """The adapter's target modules whose weight is not a float tensor to add to (quantized layers)."""
    modules = dict(model.named_modules())
    return [name for name in adapter.weights if not _has_float_weight(modules[name])]


@torch.no_grad()
def merge_adapter(model: nn.Module, adapter: LoRAAdapter) -> int:
    """W += (A B)^T for every module the adapter targets (the scale is folded into B); the delta is
    formed in float32 and added in the weight's dtype, as PEFT merges. Returns the modules merged.
    Every target must have a float weight (unmergeable_modules is empty)."""
    modules = dict(model.named_modules())
    for name, (a, b) in adapter.weights.items():
        weight = modules[name].weight
        delta = (a.to(weight.device) @ b.to(weight.device)).t()  # (out, in) float32
        weight.copy_((weight.float() + delta).to(weight.dtype))
    return len(adapter.weights)


def _has_float_weight(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module) is nn.Linear and isinstance(weight, torch.Tensor) and weight.dim() == 2
            and weight.dtype in (torch.float32, torch.bfloat16, torch.float16))


def is_merged_adapter(request: LoRARequest, merged_lora: str) -> bool:
    """Whether `request` names the adapter merged at load (the same lora_path, as written or as the same
    local folder)."""
    if request.lora_path == merged_lora:
        return True
    first, second = Path(request.lora_path).expanduser(), Path(merged_lora).expanduser()
    return first.exists() and second.exists() and first.resolve() == second.resolve()


def merged_request_id(request: LoRARequest | None, merged_lora: str, unmerged_id: int) -> int:
    """The lora_int_id a request runs with on an engine with `merged_lora`: the merged adapter (or no
    adapter: the loaded model is the fine-tune) runs as the model, 0, or as `unmerged_id` where the
    adapter could not be merged. Another adapter is a LoRAError: the engine holds no base weights."""
    if request is None or is_merged_adapter(request, merged_lora):
        return unmerged_id
    raise LoRAError(f"LoRA adapter {request.lora_name!r} ({request.lora_path}) asked for, but the engine holds the "
                    f"weights with merged_lora {merged_lora!r} merged in: only that adapter runs (use enable_lora "
                    "to serve several adapters over the base)")
