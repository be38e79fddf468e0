"""Which attention backend runs: decided once, when the model loads, from `engine.attention_backend`.

- `auto`: the first backend of AUTO_ORDER that can run here (the C kernels on the CPU in float32,
  else SDPA);
- `cpu`, `sdpa`: that backend, or a ValueError saying why it cannot run here;
- `torch`: kept for older job files; `cpu` on the CPU, `sdpa` on other devices.
"""

from __future__ import annotations

import torch

from batchgen.engine.attention.base import AttentionBackend
from batchgen.engine.attention.cpu import CpuAttention
from batchgen.engine.attention.sdpa import SdpaAttention

ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {b.name: b for b in (CpuAttention, SdpaAttention)}
AUTO_ORDER = ("cpu", "sdpa")  # SDPA runs everywhere, so auto always finds one


def select_attention_backend(requested: str, device: torch.device, dtype: torch.dtype,
                             head_dim: int) -> type[AttentionBackend]:
    """The backend class for `requested` (auto | cpu | sdpa | torch) on this device, dtype and head size."""
    if requested == "auto":
        return next(ATTENTION_BACKENDS[name] for name in AUTO_ORDER
                    if ATTENTION_BACKENDS[name].unavailable_reason(device, dtype, head_dim) is None)
    name = requested
    if requested == "torch":
        name = "cpu" if device.type == "cpu" else "sdpa"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of auto, torch, {', '.join(ATTENTION_BACKENDS)}; "
                         f"got {requested!r}")
    backend = ATTENTION_BACKENDS[name]
    reason = backend.unavailable_reason(device, dtype, head_dim)
    if reason is not None:
        alias = f" (torch means {name} on {device.type})" if requested == "torch" else ""
        raise ValueError(f"attention_backend {requested!r}{alias} cannot run here: {reason}; "
                         f"use attention_backend: auto")
    return backend
