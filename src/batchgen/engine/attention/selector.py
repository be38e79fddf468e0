"""Which attention backend runs: decided once, when the model loads, from `engine.attention_backend`.

- `auto`: on CUDA the Triton kernels; on the CPU the C kernels (float32), else SDPA (the CPU's
  fallback: other dtypes, no C compiler, head_dim not a multiple of 16). With an FP8 KV cache only
  backends that read one (cpu, triton) are candidates.
- `cpu`, `sdpa`, `triton`: that backend, or a ValueError saying why it cannot run here (triton runs
  on the CPU only under TRITON_INTERPRET=1, for tests);
- `torch`: kept for older job files; `cpu` on the CPU, `triton` on CUDA.
"""

from __future__ import annotations

import torch

from batchgen.engine.attention.base import AttentionBackend
from batchgen.engine.attention.cpu import CpuAttention
from batchgen.engine.attention.sdpa import SdpaAttention
from batchgen.engine.attention.triton import TritonAttention

ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {
    b.name: b for b in (CpuAttention, SdpaAttention, TritonAttention)}
AUTO_ORDER = {"cuda": ("triton",), "cpu": ("cpu", "sdpa")}


def select_attention_backend(requested: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                             is_fp8_kv: bool = False) -> type[AttentionBackend]:
    """The backend class for `requested` (auto | cpu | sdpa | triton | torch) on this device, dtype and
    head size; `is_fp8_kv`: the KV cache is FP8 (engine.kv_cache_dtype)."""
    if requested == "auto":
        reasons = {}
        for name in AUTO_ORDER.get(device.type, ()):
            backend = ATTENTION_BACKENDS[name]
            reason = _reason(backend, device, dtype, head_dim, is_fp8_kv)
            if reason is None:
                return backend
            reasons[name] = reason
        found = "; ".join(f"{name}: {why}" for name, why in reasons.items()) or f"none runs on {device.type}"
        raise ValueError(f"no attention backend can run here ({found})")
    name = requested
    if requested == "torch":
        name = "cpu" if device.type == "cpu" else "triton"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of auto, torch, {', '.join(ATTENTION_BACKENDS)}; "
                         f"got {requested!r}")
    backend = ATTENTION_BACKENDS[name]
    reason = _reason(backend, device, dtype, head_dim, is_fp8_kv)
    if reason is not None:
        alias = f" (torch means {name} on {device.type})" if requested == "torch" else ""
        raise ValueError(f"attention_backend {requested!r}{alias} cannot run here: {reason}; "
                         f"use attention_backend: auto")
    return backend


def _reason(backend: type[AttentionBackend], device: torch.device, dtype: torch.dtype, head_dim: int,
            is_fp8_kv: bool) -> str | None:
    if is_fp8_kv and not backend.supports_fp8_kv:
        return "it has no FP8 KV cache (engine.kv_cache_dtype: auto, or another backend)"
    return backend.unavailable_reason(device, dtype, head_dim)
