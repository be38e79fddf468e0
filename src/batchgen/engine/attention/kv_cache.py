"""The paged KV cache's tensors, one LayerKVCache per layer: what every attention backend writes and reads.

The model runner allocates them (`allocate_kv_caches`) and passes them, layer by layer, to the
backend. A cache is (num_slots, Hkv, D) for K and for V, slot = block * block_size + offset, in the
model dtype or in FP8 (`engine.kv_cache_dtype`). An FP8 cache stores clamp(x / scale) with one
float32 scale per layer for K and one for V: the checkpoint's (`k_scale` / `v_scale`, llm-compressor's
layout) when it has them, else 1.0; with `engine.calculate_kv_scales: true`, each layer's scales come
from the absolute maxima of the first step's keys and values (calibrated before that step is written,
then fixed for the engine's lifetime, so every later step is quantized alike).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from batchgen.kernels.kv_formats import FP8_KV_MAX, fp8_code_values, is_fp8_kv

# The smallest scale calculate_kv_scales sets: a layer whose first keys are all zero must not divide by 0.
MIN_KV_SCALE = 1e-8


@dataclass
class LayerKVCache:
    """One layer's K and V caches (and, for FP8, their scales). Unpacks as (k, v)."""

    k: torch.Tensor  # (num_slots, Hkv, D) in the cache dtype
    v: torch.Tensor
    k_scale: torch.Tensor | None = None  # (1,) float32 on the cache's device; FP8 caches only
    v_scale: torch.Tensor | None = None
    needs_scales: bool = False  # calculate_kv_scales: calibrate from the next step written
    _tables: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def __iter__(self):
        return iter((self.k, self.v))

    @property
    def is_fp8(self) -> bool:
        return is_fp8_kv(self.k.dtype)

    def calibrate(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """calculate_kv_scales: this step's keys and values (T, Hkv, D) set the scales, absmax / the
        format's largest value (no host sync: written on the device). No-op once calibrated."""
        if not self.needs_scales:
            return
        limit = FP8_KV_MAX[self.k.dtype]
        for scale, x in ((self.k_scale, k), (self.v_scale, v)):
            scale.copy_((x.detach().abs().amax().float() / limit).clamp_min(MIN_KV_SCALE).reshape(1))
        self.needs_scales = False
        self._tables = None

    def lookup_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The C kernels' (256,) float32 tables for an FP8 cache: byte -> value * scale, for K and V."""
        if self._tables is None:
            codes = fp8_code_values(self.k.dtype).to(self.k.device)
            self._tables = ((codes * self.k_scale).contiguous(), (codes * self.v_scale).contiguous())
        return self._tables


def allocate_kv_caches(num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                       device: torch.device, *, checkpoint_scales: dict[int, dict[str, float]] | None = None,
                       calculate_scales: bool = False, local_layers: frozenset[int] = frozenset(),
                       num_local_slots: int = 0) -> list[LayerKVCache]:
    """Zeroed caches for every layer. FP8 `dtype`: scales from checkpoint_scales ({layer: {"k": .., "v": ..}},
    missing ones 1.0), or calibrated on the first step when calculate_scales. `local_layers` (sliding-window
    layers with their own block group, kv/window_groups.py) hold `num_local_slots` slots, the others `num_slots`."""
    caches = []
    for layer in range(num_layers):
        shape = (num_local_slots if layer in local_layers else num_slots, num_kv_heads, head_dim)
        cache = LayerKVCache(torch.zeros(shape, dtype=dtype, device=device),
                             torch.zeros(shape, dtype=dtype, device=device))
        if is_fp8_kv(dtype):
            stored = (checkpoint_scales or {}).get(layer, {})
            cache.k_scale = torch.tensor([float(stored.get("k", 1.0))], dtype=torch.float32, device=device)
            cache.v_scale = torch.tensor([float(stored.get("v", 1.0))], dtype=torch.float32, device=device)
            cache.needs_scales = calculate_scales
        caches.append(cache)
    return caches


def copy_blocks(caches: list[LayerKVCache], src: torch.Tensor, dst: torch.Tensor, block_size: int) -> None:
    """Every layer's K and V of blocks `src` (C,) into blocks `dst` (C,) (int32 device tensors), bit for bit
    (FP8 caches as bytes): a fork's copy on write, run before the step that writes into the copies."""
    offsets = torch.arange(block_size, device=src.device)
    src_slots = (src.long()[:, None] * block_size + offsets).reshape(-1)  # (C * block_size,)
    dst_slots = (dst.long()[:, None] * block_size + offsets).reshape(-1)
    for cache in caches:
        for tensor in (cache.k, cache.v):
            data = tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor
            data.index_copy_(0, dst_slots, data.index_select(0, src_slots))
