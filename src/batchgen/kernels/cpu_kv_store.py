"""Cache writes for the CPU paged KV cache: a step's new keys and values into their slots, both in
one C pass (csrc/kv_store.c) instead of two index_copy_ calls with their per-call dispatch. Keys in
the cache's own dtype (float32 into float32, bfloat16 into bfloat16) are copied as bytes; float32
keys into a bfloat16 cache are rounded to nearest even in the same pass (the model computes in
float32 with bfloat16 weights on CPUs without BF16 units). An FP8 cache (float8_e4m3fn /
float8_e5m2, one float32 scale per layer for K and V) gets clamp(x / scale) cast to FP8
(kernels/kv_formats.py, in torch), then the byte copy. This module also owns the check of the cache
layout that the paged-attention kernels (kernels/cpu_paged_attention.py) read: (slots, Hkv, D)
float32, bfloat16 or FP8, contiguous, slot = block * block_size + offset.

The torch reference is kernels/reference.py's kv_store_reference. Built on first use
(kernels/c_library.py); without a compiler `is_available()` is False and the engine writes the
cache with index_copy_.
"""

from __future__ import annotations

import ctypes

import torch

from batchgen.kernels.c_library import CLibrary
from batchgen.kernels.kv_formats import is_fp8_kv, quantize_kv

_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
_LIBRARY = CLibrary("kv_store", ("kv_store.c",), {
    "store_kv": (None, [_P, _L, _P, _L, _P, _P, _P, _I, _I, _I]),
    "store_kv_to_bf16": (None, [_P, _L, _P, _L, _P, _P, _P, _I, _I, _I]),
}, fallback="the cache is written with index_copy_", headers=("bf16.h",))
CACHE_DTYPES = (torch.float32, torch.bfloat16)  # and the FP8 ones (kv_formats.FP8_KV_DTYPES)
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)


def is_available() -> bool:
    """True once the kernel is built (or found in the cache) and loaded."""
    return _LIBRARY.is_available()


def check_caches(x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The CPU kernels' cache layout: x (what is written or attended) float32 or bfloat16, both caches
    float32, bfloat16 or one FP8 dtype, contiguous (slots, Hkv, D) of one shape. TypeError/ValueError
    otherwise."""
    is_cache_dtype = k_cache.dtype in CACHE_DTYPES or is_fp8_kv(k_cache.dtype)
    if x.dtype not in ACTIVATION_DTYPES or not is_cache_dtype or v_cache.dtype != k_cache.dtype:
        raise TypeError(f"the CPU paged-attention kernels take float32 or bfloat16 tensors and float32, bfloat16 "
                        f"or FP8 caches; got {x.dtype} with a {k_cache.dtype} cache")
    if (k_cache.dim() != 3 or k_cache.shape != v_cache.shape or not k_cache.is_contiguous()
            or not v_cache.is_contiguous()):
        raise ValueError(f"caches must be contiguous (slots, kv_heads, head_dim), "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """k_cache[slot_mapping] = k and v_cache[slot_mapping] = v in one pass (index_copy_ twice, without
    its per-call dispatch). k, v: (T, Hkv, D) float32 or bfloat16 with contiguous (Hkv, D) rows (views
    into the qkv output); caches (slots, Hkv, D) contiguous; slot_mapping (T,) int64, each slot inside
    the cache. A bfloat16 cache takes float32 keys rounded to nearest even. FP8 caches: k_scale,
    v_scale (one float32 value each) divide the values before the clamp and cast."""
    lib = _LIBRARY.require()
    check_caches(k, k_cache, v_cache)
    if k.dtype == torch.bfloat16 and k_cache.dtype == torch.float32:
        raise TypeError("bfloat16 keys and values go into a bfloat16 or FP8 cache, not a float32 one")
    if v.dtype != k.dtype:
        raise TypeError(f"k and v must share a dtype, got {k.dtype} and {v.dtype}")
    num_tokens = k.shape[0]
    row_size = k_cache.shape[1] * k_cache.shape[2]
    if (k.shape != v.shape or k.shape[1:] != k_cache.shape[1:] or slot_mapping.shape != (num_tokens,)
            or any(t.stride(2) != 1 or t.stride(1) != t.shape[2] for t in (k, v))):
        raise ValueError("k and v need the caches' (Hkv, D) rows, contiguous, and one slot each")
    if not num_tokens:
        return
    slot_mapping = slot_mapping.to(torch.long).contiguous()
    if int(slot_mapping.min()) < 0 or int(slot_mapping.max()) >= k_cache.shape[0]:
        raise ValueError("a slot lies outside the cache")
    if is_fp8_kv(k_cache.dtype):
        if k_scale is None or v_scale is None:
            raise ValueError("an FP8 cache needs k_scale and v_scale")
        k, v = quantize_kv(k, k_cache.dtype, k_scale), quantize_kv(v, v_cache.dtype, v_scale)  # (T, Hkv, D)
    elif k_cache.dtype == torch.bfloat16 and k.dtype == torch.float32:
        lib.store_kv_to_bf16(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(),
                             v_cache.data_ptr(), slot_mapping.data_ptr(), num_tokens, row_size, torch.get_num_threads())
        return
    elem = k_cache.element_size()
    lib.store_kv(k.data_ptr(), k.stride(0) * elem, v.data_ptr(), v.stride(0) * elem, k_cache.data_ptr(),
                 v_cache.data_ptr(), slot_mapping.data_ptr(), num_tokens, row_size * elem, torch.get_num_threads())

