"""KV-cache capacity arithmetic: one function for bytes per token, used by the pool and `batchgen plan`."""

from __future__ import annotations

import torch

from batchgen.engine.config import EngineConfig, parse_memory_size
from batchgen.engine.models.config import ModelConfig

CPU_KV_CAP_BYTES = 4 * 2**30
CPU_KV_RAM_FRACTION = 0.20
GPU_KV_FREE_FRACTION = 0.90


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: torch.dtype) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x dtype bytes."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes(kv_dtype)


def _total_ram_bytes() -> int:
    try:
        return __import__("os").sysconf("SC_PAGE_SIZE") * __import__("os").sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 16 * 2**30


def kv_cache_budget_bytes(config: EngineConfig, device: torch.device) -> int:
    """Bytes for the KV pool: explicit size, fraction of free memory, or the design's auto rule."""
    setting = config.kv_cache_memory
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        if setting == "auto":
            return int(free * GPU_KV_FREE_FRACTION)
        value = parse_memory_size(setting)
        return int(free * value) if isinstance(value, float) else value
    ram = _total_ram_bytes()
    if setting == "auto":
        return int(min(CPU_KV_CAP_BYTES, CPU_KV_RAM_FRACTION * ram))
    value = parse_memory_size(setting)
    return int(ram * value) if isinstance(value, float) else value


def num_kv_blocks(budget_bytes: int, cfg: ModelConfig, kv_dtype: torch.dtype, block_size: int) -> int:
    return budget_bytes // (kv_bytes_per_token(cfg, kv_dtype) * block_size)
