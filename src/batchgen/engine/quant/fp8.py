"""Model-level FP8: the matmul path, nn.Linear swapped for Fp8Linear, a report of what it saved.

Quantized: every linear layer of the decoder (qkv_proj, o_proj, gate_up_proj, down_proj), and
lm_head only with `quantize_lm_head` (it is the logits' last matmul, and on tied models such as
SmolLM2 an FP8 copy adds bytes instead of saving them). Embeddings and norms stay in the model dtype.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from batchgen.engine.config import EngineConfig
from batchgen.engine.quant.fp8_linear import Fp8Linear

if TYPE_CHECKING:
    from batchgen.engine.capabilities import Capabilities

log = logging.getLogger("batchgen.engine")

# torch._scaled_mm's FP8 GEMMs need FP8 tensor cores: Ada (8.9) and Hopper (9.0) onwards.
MIN_W8A8_CAPABILITY = (8, 9)


def has_fp8_tensor_cores(device: torch.device) -> bool:
    """A CUDA device whose torch._scaled_mm runs on FP8 tensor cores (compute capability >= 8.9)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= MIN_W8A8_CAPABILITY


def resolve_fp8_mode(fp8_mode: str, device: torch.device) -> tuple[str, str]:
    """(mode, why): auto picks w8a8 on CUDA devices with FP8 tensor cores, else weight-only w8a16."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    has_fp8_cores = has_fp8_tensor_cores(device)
    where = f"CUDA compute capability {capability[0]}.{capability[1]}" if capability else device.type
    if fp8_mode == "auto":
        return ("w8a8" if has_fp8_cores else "w8a16"), f"auto on {where}"
    if fp8_mode == "w8a8" and capability is not None and not has_fp8_cores:
        raise ValueError(f"fp8_mode w8a8 needs FP8 tensor cores (compute capability >= 8.9); this GPU has "
                         f"{capability[0]}.{capability[1]}: use fp8_mode w8a16 or auto")
    if fp8_mode not in ("w8a8", "w8a16"):
        raise ValueError(f"fp8_mode must be auto, w8a8 or w8a16; got {fp8_mode!r}")
    return fp8_mode, f"asked for, on {where}"


def fp8_matmul_path(config: EngineConfig) -> tuple[str, str, bool]:
    """(mode, why, use_triton): the FP8 matmul path for this config's device and dtype. The engine
    asks once at load (capabilities.py); harnesses that quantize a bare model ask through
    quantize_model_fp8."""
    mode, why = resolve_fp8_mode(config.fp8_mode, config.torch_device)
    use_triton = mode == "w8a16" and can_use_triton_w8a16(config.torch_device, config.torch_dtype)
    return mode, why, use_triton


def is_quantizable(name: str, module: nn.Module, quantize_lm_head: bool) -> bool:
    return isinstance(module, nn.Linear) and (name != "lm_head" or quantize_lm_head)


def quantize_model_fp8(model: nn.Module, config: EngineConfig, source=None,
                       capabilities: Capabilities | None = None) -> dict:
    """Quantize the model's linear layers in place (layers an FP8 checkpoint loaded stay as stored).

    `capabilities`: the matmul path the engine decided at load; None (a harness quantizing a bare
    model) decides it here from `config`.
    Returns the summary it logs: fp8_mode, num_layers, float bytes before, fp8 bytes after (scales included).
    """
    from batchgen.engine.quant.fp8_checkpoint import check_fp8_scales_loaded

    if capabilities is not None and capabilities.fp8_mode is not None:
        mode, why, use_triton = capabilities.fp8_mode, capabilities.fp8_reason, capabilities.is_triton_fp8_w8a16
    else:
        mode, why, use_triton = fp8_matmul_path(config)
    from_checkpoint = any(isinstance(m, Fp8Linear) for m in model.modules())
    if from_checkpoint:
        # An FP8 checkpoint decided which layers are FP8 (its ignored layers stay as they are).
        check_fp8_scales_loaded(model)
        num_float_bytes = None
    else:
        num_float_bytes = 0
        for name, module in list(model.named_modules()):
            if is_quantizable(name, module, config.quantize_lm_head):
                num_float_bytes += module.weight.numel() * module.weight.element_size()
                _replace_module(model, name, Fp8Linear.from_linear(module))
    # Mixture-of-experts models: the routed experts too, weight-only (quant/fp8_experts.py), as vLLM does.
    from batchgen.engine.quant.fp8_experts import quantize_experts_fp8

    num_expert_modules, num_expert_float_bytes, num_expert_fp8_bytes = quantize_experts_fp8(model)
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    quantize_on_triton = mode == "w8a8" and can_use_triton_fp8_quant(config.torch_device, config.torch_dtype)
    for m in layers:
        m.set_mode(mode)
        m.use_triton = use_triton
        m.quantize_on_triton = quantize_on_triton
    num_fp8_bytes = sum(fp8_layer_bytes(m) for m in layers)
    num_fallback = sum(m.mode != mode for m in layers)
    summary = {"fp8_mode": mode, "reason": why, "uses_triton": use_triton,
               "quantizes_activations_on_triton": quantize_on_triton, "from_checkpoint": from_checkpoint,
               "num_layers": len(layers), "num_float_bytes": num_float_bytes, "num_fp8_bytes": num_fp8_bytes,
               "num_w8a16_fallback_layers": num_fallback, "num_expert_modules": num_expert_modules,
               "num_expert_float_bytes": num_expert_float_bytes, "num_expert_fp8_bytes": num_expert_fp8_bytes}
    origin = f"read from the checkpoint {getattr(source, 'display_name', '')}".rstrip() if from_checkpoint \
        else "quantized at load"
    ratio = f" ({num_fp8_bytes / num_float_bytes:.1%} of {num_float_bytes / 1e6:.1f} MB)" if num_float_bytes else ""
    log.info("fp8: %d linear layers %s, %.1f MB with scales%s; matmul path %s%s (%s)%s", len(layers), origin,
             num_fp8_bytes / 1e6, ratio, mode, " (Triton kernel)" if use_triton else "", why,
             f"; {num_fallback} layers with K or N not divisible by 16 use w8a16" if num_fallback else "")
    if num_expert_modules:
        log.info("fp8: the routed experts of %d MoE layers quantized at load (w8a16), %.1f MB with scales (%.1f%% of "
                 "%.1f MB)", num_expert_modules, num_expert_fp8_bytes / 1e6,
                 100 * num_expert_fp8_bytes / num_expert_float_bytes, num_expert_float_bytes / 1e6)
    return summary


def _passes_probe(what: str, fallback: str, compare) -> bool:
    """Run `compare()` (the kernel against its reference on a small input -> is it close); False,
    with a warning naming the fallback, if it raises or disagrees.

    A probe rather than a capability table: if Triton is missing or cannot build a kernel for this
    GPU, the layer takes its torch path instead of failing mid-run."""
    try:
        is_ok = bool(compare())
    except Exception as exc:
        log.warning("fp8: Triton %s unavailable (%s: %s); using %s", what, type(exc).__name__, exc, fallback)
        return False
    if not is_ok:
        log.warning("fp8: Triton %s disagrees with its reference here; using %s", what, fallback)
    return is_ok


def can_use_triton_w8a16(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the Triton weight-only kernel compiles and matches its reference here (CUDA only)."""
    if device.type != "cuda":
        return False

    def compare() -> bool:
        from batchgen.engine.quant.fp8_tensor import quantize_fp8
        from batchgen.kernels.fp8_matmul import fp8_w8a16_matmul
        from batchgen.kernels.reference import fp8_w8a16_matmul_ref

        gen = torch.Generator(device=device).manual_seed(0)
        q, scale = quantize_fp8(torch.randn(96, 80, device=device, generator=gen))
        x = torch.randn(5, 80, device=device, generator=gen).to(dtype)
        out, ref = fp8_w8a16_matmul(x, q, scale).float(), fp8_w8a16_matmul_ref(x, q, scale).float()
        return ((out - ref).norm() / ref.norm()) < 1e-2

    return _passes_probe("w8a16 kernel", "dequantize-then-matmul", compare)


def can_use_triton_fp8_quant(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the fused per-token activation quantization (kernels/fp8_quant.py) compiles and matches
    its reference here (CUDA only): W8A8 layers then quantize their input in one launch."""
    if device.type != "cuda":
        return False

    def compare() -> bool:
        from batchgen.kernels.fp8_quant import quantize_fp8_per_token_triton
        from batchgen.kernels.reference import quantize_fp8_per_token_ref

        x = torch.randn(5, 80, device=device, generator=torch.Generator(device=device).manual_seed(0)).to(dtype)
        (q, scale), (q_ref, scale_ref) = quantize_fp8_per_token_triton(x), quantize_fp8_per_token_ref(x)
        return torch.equal(scale, scale_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))

    return _passes_probe("per-token quantization kernel", "torch ops", compare)


def fp8_layer_bytes(module: Fp8Linear) -> int:
    """Bytes of an Fp8Linear's FP8 weight and float32 scales (not its bias, which stays in the model dtype)."""
    tensors = [module.weight, module.weight_scale] + ([module.input_scale] if module.input_scale is not None else [])
    return sum(t.numel() * t.element_size() for t in tensors)


def _replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
