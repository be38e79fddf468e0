"""KV store: a step's new keys and values written into their cache slots, before attention reads them.

The cache is slot-major, (num_slots, kv_heads, head_size) per layer with slot = block * block_size +
offset, so a token's slot is all the kernel needs (no block table). A slot of -1 writes nothing
(padding rows of a CUDA-graph batch). Slot offsets are computed in int64: a large pool passes 2**31
elements.

FP8 caches (float8_e4m3fn, float8_e5m2) store x / scale with one fp32 scale per layer for K and one
for V, clamped to the format's largest finite value first (e4m3fn has no infinity: an overflow would
become NaN).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.kernels.kv_formats import FP8_KV_DTYPES, FP8_KV_MAX, is_fp8_kv

__all__ = ["FP8_KV_DTYPES", "FP8_KV_MAX", "check_kv_scales", "is_fp8_kv", "store_kv"]


def check_kv_scales(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, device: torch.device) -> None:
    """An FP8 cache's scales: one float32 value each, on the kernel's device (read there, no sync)."""
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None or scale.dtype != torch.float32 or scale.numel() != 1 or scale.device != device:
            raise ValueError(f"an FP8 cache needs {name} as one float32 value on {device}")


@triton.jit
def _kv_store_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    num_kv_heads,
    stride_key_t, stride_key_h, stride_value_t, stride_value_h,
    stride_kc_s, stride_kc_h, stride_vc_s, stride_vc_h,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
    IS_FP8: tl.constexpr, FP8_MAX: tl.constexpr,
):
    token = tl.program_id(0)
    head_block = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)  # (BLOCK_H,)
    dims = tl.arange(0, HEAD_PAD)  # (HEAD_PAD,)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < HEAD_SIZE)  # (BLOCK_H, HEAD_PAD)
    token64 = token.to(tl.int64)
    key = tl.load(key_ptr + token64 * stride_key_t + heads[:, None] * stride_key_h + dims[None, :], mask=mask)
    value = tl.load(value_ptr + token64 * stride_value_t + heads[:, None] * stride_value_h + dims[None, :],
                    mask=mask)
    if IS_FP8:
        key = key.to(tl.float32) / tl.load(k_scale_ptr)
        value = value.to(tl.float32) / tl.load(v_scale_ptr)
        key = tl.minimum(tl.maximum(key, -FP8_MAX), FP8_MAX)
        value = tl.minimum(tl.maximum(value, -FP8_MAX), FP8_MAX)
    tl.store(k_cache_ptr + slot * stride_kc_s + heads[:, None] * stride_kc_h + dims[None, :],
             key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + slot * stride_vc_s + heads[:, None] * stride_vc_h + dims[None, :],
             value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Write key/value (T, kv_heads, head_size) into k_cache/v_cache (num_slots, kv_heads, head_size)
    at slot_mapping (T,) int32/int64, in place; slot -1 writes nothing.

    key and value may be strided views (e.g. slices of a fused qkv projection) as long as head_size
    is contiguous. Without FP8 the cache dtype must equal the input's. With an FP8 cache, k_scale and
    v_scale are the layer's fp32 scales (one element each, on the device): the cache holds
    clamp(x / scale) cast to FP8. Slot values are not checked (that would need a device sync): each
    must be -1 or below num_slots, and no two tokens may share a slot.
    """
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(f"key and value must be (T, kv_heads, head_size) of one shape, "
                         f"got {tuple(key.shape)} and {tuple(value.shape)}")
    num_tokens, num_kv_heads, head_size = key.shape
    if k_cache.dim() != 3 or k_cache.shape[1:] != (num_kv_heads, head_size) or v_cache.shape != k_cache.shape:
        raise ValueError(f"caches must be (num_slots, {num_kv_heads}, {head_size}) of one shape, "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if v_cache.dtype != k_cache.dtype or value.dtype != key.dtype:
        raise ValueError("k_cache/v_cache and key/value must each share a dtype")
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be ({num_tokens},) int32/int64, "
                         f"got {tuple(slot_mapping.shape)} {slot_mapping.dtype}")
    if not slot_mapping.is_contiguous():
        raise ValueError("slot_mapping must be contiguous")
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_size (stride(-1) == 1)")
        if t.device != key.device:
            raise ValueError(f"{name} is on {t.device}, key on {key.device}")
    is_fp8 = is_fp8_kv(k_cache.dtype)
    if is_fp8:
        check_kv_scales(k_scale, v_scale, key.device)
    elif k_cache.dtype != key.dtype:
        raise ValueError(f"cache dtype {k_cache.dtype} differs from key dtype {key.dtype}")
    if num_tokens == 0:
        return
    head_pad = triton.next_power_of_2(head_size)
    # One program per token and group of heads: up to 8 heads x head_size values per program.
    block_h = min(triton.next_power_of_2(num_kv_heads), 8)
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    # Without FP8 the scale pointers are never read: any tensor stands in.
    _kv_store_kernel[grid](
        key, value, k_cache, v_cache, slot_mapping,
        k_scale if is_fp8 else key, v_scale if is_fp8 else key,
        num_kv_heads,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        HEAD_SIZE=head_size, HEAD_PAD=head_pad, BLOCK_H=block_h,
        IS_FP8=is_fp8, FP8_MAX=FP8_KV_MAX.get(k_cache.dtype, 0.0),
    )
