"""Cache writes for the CPU paged KV cache in float32: a step's new keys and values into their
slots, both in one C pass (csrc/kv_store.c) instead of two index_copy_ calls with their per-call
dispatch. This module also owns the check of the cache layout that the paged-attention kernels
(kernels/cpu_paged_attention.py) read: (slots, Hkv, D) float32, contiguous, slot = block *
block_size + offset.

The torch reference is kernels/reference.py's store_kv_ref. Built on first use
(kernels/c_library.py); without a compiler `is_available()` is False and the engine writes the
cache with index_copy_.
"""

from __future__ import annotations

import ctypes

import torch

from batchgen.kernels.c_library import CLibrary

_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
_LIBRARY = CLibrary("kv_store", ("kv_store.c",), {
    "store_kv": (None, [_P, _L, _P, _L, _P, _P, _P, _I, _I, _I]),
}, fallback="the cache is written with index_copy_")


def is_available() -> bool:
    """True once the kernel is built (or found in the cache) and loaded."""
    return _LIBRARY.is_available()


def check_caches(x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The CPU kernels' cache layout: x (what is written or attended) and both caches float32, the
    caches contiguous (slots, Hkv, D) of one shape. TypeError/ValueError otherwise."""
    if x.dtype != torch.float32 or k_cache.dtype != torch.float32 or v_cache.dtype != torch.float32:
        raise TypeError("the CPU paged-attention kernels take float32 tensors")
    if (k_cache.dim() != 3 or k_cache.shape != v_cache.shape or not k_cache.is_contiguous()
            or not v_cache.is_contiguous()):
        raise ValueError(f"caches must be contiguous (slots, kv_heads, head_dim), "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k_cache[slot_mapping] = k and v_cache[slot_mapping] = v in one pass (index_copy_ twice, without
    its per-call dispatch). k, v: (T, Hkv, D) float32 with contiguous (Hkv, D) rows (views into the
    qkv output); caches (slots, Hkv, D) contiguous; slot_mapping (T,) int64, each slot inside the cache."""
    lib = _LIBRARY.require()
    check_caches(k, k_cache, v_cache)
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
    lib.store_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                 slot_mapping.data_ptr(), num_tokens, row_size, torch.get_num_threads())

