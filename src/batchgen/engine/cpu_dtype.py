"""What `dtype: auto` means on this CPU (EngineConfig.torch_dtype asks it; capabilities.py reports it).

It depends on the CPU alone, never on an engine's settings, so the config can ask it without
importing the capabilities that are decided from a config.
"""

from __future__ import annotations

import functools

import torch

from batchgen.engine.models.cpu_linear import can_pack
from batchgen.kernels import cpu_isa, cpu_paged_attention


@functools.cache
def auto_cpu_dtype() -> torch.dtype:
    """`dtype: auto` on the CPU: bfloat16 where it runs on BF16 units (half the weight and KV bytes,
    twice the dot-product rate of float32: AVX-512 BF16 or AMX), else float32 (without BF16 units the
    GEMMs compute in float32 anyway, and bfloat16 only adds rounding)."""
    try:
        isa = cpu_isa.selected_isa()
    except ValueError:
        return torch.float32
    if cpu_isa.has_bf16_units(isa) and cpu_paged_attention.is_available() and can_pack(torch.device("cpu"),
                                                                                       torch.bfloat16):
        return torch.bfloat16
    return torch.float32
