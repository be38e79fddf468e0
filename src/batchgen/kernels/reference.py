"""Pure-torch references of every kernel in this package: each takes the kernel's arguments and
returns (or writes) what the kernel must, computed the plain way. tests/kernels/ compares each
kernel to its reference.

- Paged attention and the greedy pick compute in float64: the truth the kernels are held to. One
  reference each for the KV store and for paged attention, whichever kernel (C or Triton) runs.
- The elementwise ops (RMSNorm, residual add + RMSNorm, rotary, SiLU * up) are the engine's own eager
  ops (engine/models/ops.py uses these functions), so they follow HF's op order and dtypes: in
  float32, rms_norm_ref equals HF's LlamaRMSNorm bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchgen.kernels.kv_formats import FP8_KV_MAX, is_fp8_kv

# ---- Triton ---------------------------------------------------------------------------------------


def fp8_w8a16_matmul_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (M, K), weight (N, K) float8_e4m3fn, scale (N,) or (1,) float32 -> (M, N) in x's dtype.

    Accumulates in float32 like the kernel: (x @ q^T) * scale.
    """
    return ((x.float() @ weight.float().t()) * scale.float().reshape(1, -1)).to(x.dtype)


def quantize_fp8_per_token_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (q (M, K) float8_e4m3fn, scale (M, 1) float32): scale = max(amax(|row|) / 448, 1e-12)."""
    x32 = x.float()
    scale = (x32.abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-12)
    return (x32 / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale


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


def rotary_interleaved_ref(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """GLM's rotary on adjacent pairs, x * cos + rotate_pairs(x) * sin (HF's interleaved rotate_half),
    as x * cos + swap_pairs(x) * signed_sin (signed_sin: sin with each pair's first element negated;
    partial rotary: cos 1 and sin 0 past the rotated dimensions). x: (T, heads, D); cos, signed_sin:
    (T, 1, D). Returns a new tensor."""
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)  # (T, heads, D): x[2i + 1], x[2i] side by side
    return torch.addcmul(x * cos, swapped, signed_sin)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: (T, 2 * inter). Returns silu(gate) * up, (T, inter)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def gelu_tanh_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: (T, 2 * inter). Returns gelu_tanh(gate) * up, (T, inter): Gemma's GeGLU (HF's
    gelu_pytorch_tanh)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh").mul_(up)


# ---- greedy sampling (cpu_sampling) ---------------------------------------------------------------


def argmax_log_z_ref(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (N, V) -> (first index of each row's maximum (N,) int64, log sum exp of each row (N,)
    computed in float64, in logits' dtype)."""
    return logits.argmax(dim=-1), torch.logsumexp(logits.double(), dim=-1).to(logits.dtype)


# ---- paged KV cache: the one reference of the KV store (cpu_kv_store, triton_kv_store) and of paged
# attention (cpu_paged_attention's decode and prefill kernels, triton_paged_attention). Plain loops over
# sequences, in float64 over the dequantized cache.


def dequantize_kv_reference(cache: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """A KV cache as float64: FP8 values times their per-layer scale, other dtypes widened."""
    if is_fp8_kv(cache.dtype):
        return cache.double() * scale.double().reshape(())
    return cache.double()


def quantize_kv_reference(x: torch.Tensor, dtype: torch.dtype,
                          scale: torch.Tensor | None = None) -> torch.Tensor:
    """x as stored in a cache of `dtype`: FP8 = clamp(x / scale) to the format's finite range, cast."""
    if is_fp8_kv(dtype):
        limit = FP8_KV_MAX[dtype]
        return (x.float() / scale.float().reshape(())).clamp(-limit, limit).to(dtype)
    return x.to(dtype)


def kv_store_reference(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                       v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of k_cache/v_cache (num_slots, Hkv, D) with key/value (T, Hkv, D) written at slot_mapping (T,),
    quantized when the cache is FP8; slot -1 writes nothing. The caches given are left alone."""
    k_out, v_out = k_cache.clone(), v_cache.clone()
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            k_out[slot] = quantize_kv_reference(key[token], k_cache.dtype, k_scale)
            v_out[slot] = quantize_kv_reference(value[token], v_cache.dtype, v_scale)
    return k_out, v_out


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, cu_query_lens: torch.Tensor, seq_lens: torch.Tensor,
                              sm_scale: float, block_size: int, k_scale: torch.Tensor | None = None,
                              v_scale: torch.Tensor | None = None, sliding_window: int | None = None,
                              softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of one step's queries q (T, Hq, D) over the paged cache -> (T, Hq, D) in q's dtype.

    Sequence s owns queries [cu_query_lens[s], cu_query_lens[s+1]) and seq_lens[s] cached keys (this
    step's included) at slots block_tables[s, pos // block_size] * block_size + pos % block_size;
    its query i sees keys [0, seq_len - query_len + i]: a decode is a sequence with one query, a
    prefill chunk over a cached prefix one with context seq_len - query_len. Tokens of no sequence
    are left 0. FP8 caches are read dequantized (k_scale, v_scale). Computed in float64.
    `sliding_window` W: a query at position p sees only keys at positions > p - W (transformers'
    sliding_window_overlay: the last W positions, itself included). `softcap` c: scores become
    c * tanh(scores / c) (after sm_scale, before the mask; Gemma 2's attn_logit_softcapping).
    `sinks` (Hq,): a logit per query head that joins each row's softmax denominator and weighs no
    value (gpt-oss's attention sinks, as transformers' eager attention: a sink column appended to the
    scores, dropped after the softmax).
    """
    num_q_heads = q.shape[1]
    group = num_q_heads // k_cache.shape[1]
    keys = dequantize_kv_reference(k_cache, k_scale)  # (num_slots, Hkv, D) float64
    values = dequantize_kv_reference(v_cache, v_scale)
    out = torch.zeros(q.shape, dtype=q.dtype)
    cu = cu_query_lens.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = cu[s], cu[s + 1]
        if hi == lo:
            continue
        pos = torch.arange(seq_len)
        slots = block_tables[s].long()[pos // block_size] * block_size + pos % block_size
        k = keys[slots].repeat_interleave(group, dim=1)  # (L, Hq, D)
        v = values[slots].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[lo:hi].double(), k) * sm_scale  # (Hq, Q, L)
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        context_len = seq_len - (hi - lo)
        q_pos = context_len + torch.arange(hi - lo)[:, None]  # (Q, 1) each query's position
        is_seen = pos[None, :] <= q_pos  # (Q, L)
        if sliding_window:
            is_seen &= pos[None, :] > q_pos - sliding_window
        scores = scores.masked_fill(~is_seen, float("-inf"))
        if sinks is not None:
            sink = sinks.double().reshape(-1, 1, 1).expand(-1, hi - lo, 1)  # (Hq, Q, 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        out[lo:hi] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
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


def lora_segments_ref(x: torch.Tensor, out: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                      token_order: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor,
                      slot_ranks: torch.Tensor) -> torch.Tensor:
    """SGMV shrink + expand, one token at a time in float64: out[t] + x[t] @ A[slot][:, :r] @ B[slot][:r]
    for every token t of every segment (a new tensor in out's dtype; tokens in no segment unchanged)."""
    result = out.double().clone()
    for s in range(seg_slots.numel()):
        slot = int(seg_slots[s])
        rank = int(slot_ranks[slot])
        for i in range(int(seg_starts[s]), int(seg_starts[s + 1])):
            t = int(token_order[i])
            result[t] += x[t].double() @ lora_a[slot, :, :rank].double() @ lora_b[slot, :rank].double()
    return result.to(out.dtype)
