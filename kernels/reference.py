"""Pure-torch references of the Triton kernels in this package (the tests compare each kernel to these)."""

from __future__ import annotations

import torch


def fp8_w8a16_matmul_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (M, K), weight (N, K) float8_e4m3fn, scale (N,) or (1,) float32 -> (M, N) in x's dtype.

    Accumulates in float32 like the kernel: (x @ q^T) * scale.
    """
    return ((x.float() @ weight.float().t()) * scale.float().reshape(1, -1)).to(x.dtype)


# ---------------------------------------------------------------------------------------------------
# Paged attention and KV store (references of triton_paged_attention.py and triton_kv_store.py).
# Plain loops over sequences; everything in float32 over the dequantized cache.
# ---------------------------------------------------------------------------------------------------

_FP8_KV_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def dequantize_kv_reference(cache: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """A KV cache as float32: FP8 values times their per-layer scale, other dtypes widened."""
    if cache.dtype in _FP8_KV_MAX:
        return cache.float() * scale.float().reshape(())
    return cache.float()


def quantize_kv_reference(x: torch.Tensor, dtype: torch.dtype,
                          scale: torch.Tensor | None = None) -> torch.Tensor:
    """x as stored in a cache of `dtype`: FP8 = clamp(x / scale) to the format's finite range, cast."""
    if dtype in _FP8_KV_MAX:
        limit = _FP8_KV_MAX[dtype]
        return (x.float() / scale.float().reshape(())).clamp(-limit, limit).to(dtype)
    return x.to(dtype)


def kv_store_reference(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                       v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of k_cache/v_cache (num_slots, Hkv, D) with key/value (T, Hkv, D) written at slot_mapping (T,);
    slot -1 writes nothing."""
    k_out, v_out = k_cache.clone(), v_cache.clone()
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            k_out[slot] = quantize_kv_reference(key[token], k_cache.dtype, k_scale)
            v_out[slot] = quantize_kv_reference(value[token], v_cache.dtype, v_scale)
    return k_out, v_out


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, cu_query_lens: torch.Tensor, seq_lens: torch.Tensor,
                              sm_scale: float, block_size: int, k_scale: torch.Tensor | None = None,
                              v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of one step's queries q (T, Hq, D) over the paged cache -> (T, Hq, D) in q's dtype.

    Sequence s owns queries [cu_query_lens[s], cu_query_lens[s+1]) and seq_lens[s] cached keys (this
    step's included) at slots block_tables[s, pos // block_size] * block_size + pos % block_size;
    its query i sees keys [0, seq_len - query_len + i]. Tokens of no sequence are left 0.
    """
    num_q_heads = q.shape[1]
    group = num_q_heads // k_cache.shape[1]
    keys = dequantize_kv_reference(k_cache, k_scale)  # (num_slots, Hkv, D) float32
    values = dequantize_kv_reference(v_cache, v_scale)
    out = torch.zeros_like(q)
    cu = cu_query_lens.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = cu[s], cu[s + 1]
        if hi == lo:
            continue
        pos = torch.arange(seq_len)
        slots = block_tables[s].long()[pos // block_size] * block_size + pos % block_size
        k = keys[slots].repeat_interleave(group, dim=1)  # (L, Hq, D)
        v = values[slots].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[lo:hi].float(), k) * sm_scale  # (Hq, Q, L)
        context_len = seq_len - (hi - lo)
        is_seen = pos[None, :] <= context_len + torch.arange(hi - lo)[:, None]  # (Q, L)
        scores = scores.masked_fill(~is_seen, float("-inf"))
        out[lo:hi] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out


# ---------------------------------------------------------------------------------------------------
# Weight-only integer matmul (reference of triton_int_matmul.py). Codes unpacked, one per byte.
# ---------------------------------------------------------------------------------------------------

def int_weight_matmul_ref(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                          group_size: int, g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K), codes (N, K) unsigned integers, scales/zeros (N, G) -> (M, N) in x's dtype.

    w[n, k] = (codes[n, k] - zeros[n, g(k)]) * scales[n, g(k)], g(k) = g_idx[k] or k // group_size;
    the product accumulates in float32 like the kernel.
    """
    k = codes.shape[1]
    groups = g_idx.long() if g_idx is not None else torch.arange(k, device=codes.device) // group_size
    w = (codes.float() - zeros.float()[:, groups]) * scales.float()[:, groups]  # (N, K)
    return (x.float() @ w.t()).to(x.dtype)
