"""Pure-torch references of every kernel in this package: each takes the kernel's arguments and
returns (or writes) what the kernel must, computed the plain way. tests/kernels/ compares each
kernel to its reference.

- Attention and the greedy pick compute in float64: the truth the float32 kernels are held to.
- The elementwise ops (RMSNorm, residual add + RMSNorm, rotary, SiLU * up) are the engine's own eager
  ops (engine/models/ops.py uses these functions), so they follow HF's op order and dtypes: in
  float32, rms_norm_ref equals HF's LlamaRMSNorm bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# ---- Triton ---------------------------------------------------------------------------------------


def fp8_w8a16_matmul_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (M, K), weight (N, K) float8_e4m3fn, scale (N,) or (1,) float32 -> (M, N) in x's dtype.

    Accumulates in float32 like the kernel: (x @ q^T) * scale.
    """
    return ((x.float() @ weight.float().t()) * scale.float().reshape(1, -1)).to(x.dtype)


# ---- paged KV cache (cpu_kv_store, cpu_paged_attention) ---------------------------------------------


def _slots(table: torch.Tensor, num_tokens: int, block_size: int) -> torch.Tensor:
    """Cache slots of a sequence's tokens [0, num_tokens) through its block table: (num_tokens,) int64."""
    positions = torch.arange(num_tokens)
    return table.long()[positions // block_size] * block_size + positions % block_size


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """k_cache[slot_mapping] = k and v_cache[slot_mapping] = v. k, v: (T, Hkv, D); caches (slots, Hkv, D)."""
    k_cache.index_copy_(0, slot_mapping, k)
    v_cache.index_copy_(0, slot_mapping, v)


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, lengths: torch.Tensor, block_size: int,
                               scale: float) -> torch.Tensor:
    """Row b's G query heads per KV head attend its keys [0, lengths[b]), found through its block table.

    q: (B, Hkv, G, D); caches (slots, Hkv, D); block_tables (B, max_blocks); lengths (B,).
    Computed in float64; returns (B, Hkv, G, D) in q's dtype.
    """
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(q.shape[0]):
        slots = _slots(block_tables[b], int(lengths[b]), block_size)
        k, v = k_cache[slots].double(), v_cache[slots].double()  # (L, Hkv, D)
        scores = torch.einsum("hgd,lhd->hgl", q[b].double(), k) * scale
        out[b] = torch.einsum("hgl,lhd->hgd", scores.softmax(-1), v)
    return out.to(q.dtype)


def paged_prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                token_starts: torch.Tensor, query_lens: torch.Tensor,
                                context_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                                scale: float, out: torch.Tensor) -> None:
    """Each prefill sequence's queries attend its cached context and themselves causally: query i
    of a sequence with context C sees its keys [0, C + i], found through its block table.

    q, out: (T, H, D); caches (slots, Hkv, D); per sequence its first flat token, query length,
    context length and block table (S, max_blocks). Computed in float64; writes the sequences' rows
    of `out` (in out's dtype) and leaves the others alone.
    """
    group = q.shape[1] // k_cache.shape[1]
    for s in range(query_lens.shape[0]):
        start, num_q, context = int(token_starts[s]), int(query_lens[s]), int(context_lens[s])
        slots = _slots(block_tables[s], context + num_q, block_size)
        k = k_cache[slots].double().repeat_interleave(group, dim=1)  # (C + Q, H, D)
        v = v_cache[slots].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:start + num_q].double(), k) * scale
        # (Q, C + Q): query i sees keys [0, C + i]
        is_visible = torch.arange(context + num_q)[None, :] <= (context + torch.arange(num_q))[:, None]
        probs = scores.masked_fill(~is_visible, float("-inf")).softmax(-1)
        out[start:start + num_q] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)


# ---- elementwise (cpu_elementwise): the engine's eager ops --------------------------------------------


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x) over the last dim."""
    if x.dtype == torch.float32:
        # One fused op; in float32 it computes HF's expression below bit for bit (checked in tests).
        return F.rms_norm(x, weight.shape, weight, eps)
    # HF's op order (normalize in float32, scale in the model dtype), for matching logits.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); neither input is written."""
    total = x + residual
    return rms_norm_ref(total, weight, eps), total


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half rotary, x * cos + rotate_half(x) * sin, as x * cos + swap_halves(x) * signed_sin
    (signed_sin = sin with its first half negated): two passes fewer. x: (T, heads, D); cos,
    signed_sin: (T, 1, D). Returns a new tensor (the C kernel works in place)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: (T, 2 * inter). Returns silu(gate) * up, (T, inter)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


# ---- greedy sampling (cpu_sampling) ---------------------------------------------------------------


def argmax_log_z_ref(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (N, V) -> (first index of each row's maximum (N,) int64, log sum exp of each row (N,)
    computed in float64, in logits' dtype)."""
    return logits.argmax(dim=-1), torch.logsumexp(logits.double(), dim=-1).to(logits.dtype)


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
