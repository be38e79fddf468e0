"""Paged attention for the CPU, read in place from the paged KV cache: small C kernels
(csrc/paged_decode.c, csrc/paged_prefill.c), computing in float32 whatever the storage.

Decode: SDPA's CPU flash kernel is built for long query blocks; a decode step has 1 query per
sequence (a GQA group of `group` query heads per KV head), and there it reads K/V well below the
rate of a plain streaming read, and it needs the keys dense, so the SDPA path keeps a staged copy
of every decoding row (engine/attention/decode_staging.py). The decode kernel walks each row's block table
instead: it reads each token's (Hkv, D) record of K once for all the row's query heads, runs an
exact two-pass softmax in float32 over the row's own length (no padding, no mask), then reads V the
same way, prefetching the next block. No staging copy: no fills, appends or first-touch page
faults, no second copy of the KV.

Prefill: each (chunk, KV head) gathers its keys [0, context + queries) out of their blocks once (K
transposed, V in rows), then computes scores in 6 x 16 register tiles, an exact softmax per row
over the keys it may see, and P V in 6 x 64 tiles: fresh prompts and chunks that continue a cached
prefix alike, with no padding and no mask tensor. (Measured rates against SDPA:
docs/benchmarks/history/cpu-throughput.md.)

FP8 caches (float8_e4m3fn / float8_e5m2): both kernels read one byte per value and widen it through
the layer's 256-entry lookup table (`fp8_lookup_table`: byte -> value * scale), a quarter of the
bytes of a float32 cache. bfloat16 caches: two bytes per value, widened by a 16-bit shift. Queries
and outputs are float32, or bfloat16 (with a bfloat16 cache: the model computing in bfloat16), then
widened per row or tile and the float32 results rounded to nearest even. On BF16 units (AVX-512
BF16), bfloat16 decode queries over a bfloat16 cache (head_dim 64 or 128) skip the widening: both
products run on vdpbf16ps, with the softmax's probabilities rounded to bfloat16 before P V as
FlashAttention does on GPUs (`decode_rounds_probabilities` says when; 1.3-1.6x the widening form).

The torch reference is kernels/reference.py's paged_attention_reference; the cache write these kernels read after is kernels/cpu_kv_store.py.
Work is split over threads by OpenMP, in torch's own thread pool. Built on first use
(kernels/c_library.py); without a compiler (or off Linux) `is_available()` is False and the engine
attends with SDPA.
"""

from __future__ import annotations

import ctypes

import torch

from batchgen.kernels.c_library import CLibrary
from batchgen.kernels.cpu_kv_store import check_caches
from batchgen.kernels.kv_formats import fp8_code_values, is_fp8_kv

_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
_LIBRARY = CLibrary("paged_attention", ("paged_decode.c", "paged_prefill.c"), {
    # ..., scale, cache_bf16, io_bf16, window, softcap, sinks, num_threads
    "paged_decode_attention": (_I, [_P] * 8 + [_I] * 6 + [ctypes.c_float, _I, _I, _I, ctypes.c_float, _P, _I]),
    "paged_prefill_attention": (_I, [_P, _L, _P, _P, _P, _P, _P, _L] + [_P] * 4 + [_I] * 6
                                + [ctypes.c_float, _I, _I, _I, ctypes.c_float, _P, _I]),
    "paged_decode_rounds_probabilities": (_I, [_I, _I]),
}, fallback="attention runs through SDPA (decodes staged)", headers=("bf16.h",))


def is_available() -> bool:
    """True once the kernel is built (or found in the cache) and loaded."""
    return _LIBRARY.is_available()


def decode_rounds_probabilities(head_dim: int, block_size: int) -> bool:
    """True when bfloat16 queries over a bfloat16 cache of these sizes decode on BF16 units
    (vdpbf16ps for Q K and P V), the softmax's probabilities rounded to bfloat16 before P V as
    FlashAttention rounds P on GPUs: each output moves by at most 2^-9 x sum_t p_t |v_t| (<= 2^-9 x
    max |v|) beyond the float32-accumulating kernels."""
    return bool(_LIBRARY.require().paged_decode_rounds_probabilities(head_dim, block_size))


def fp8_lookup_table(dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """(256,) float32 for an FP8 cache of `dtype` with this layer's scale: byte b -> value(b) * scale."""
    return (fp8_code_values(dtype) * scale.float().reshape(())).contiguous()


def _lut_pointers(k_cache: torch.Tensor, k_lut: torch.Tensor | None, v_lut: torch.Tensor | None) -> tuple:
    """The tables' addresses for the C code (None for a float32 cache); an FP8 cache must have both."""
    if not is_fp8_kv(k_cache.dtype):
        return None, None
    for lut in (k_lut, v_lut):
        if lut is None or lut.shape != (256,) or lut.dtype != torch.float32 or not lut.is_contiguous():
            raise ValueError("an FP8 cache needs k_lut and v_lut: (256,) float32 tables (fp8_lookup_table)")
    return k_lut.data_ptr(), v_lut.data_ptr()


def _formats(q: torch.Tensor, k_cache: torch.Tensor) -> tuple[int, int]:
    """The kernels' (cache_bf16, io_bf16) flags."""
    return int(k_cache.dtype == torch.bfloat16), int(q.dtype == torch.bfloat16)


def _window_softcap(sliding_window: int | None, softcap: float | None) -> tuple[int, float]:
    """The kernels' (window, softcap) arguments: 0 for none; ValueError for a window below 1 or a
    cap that is not positive."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1 (or None), got {sliding_window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive (or None), got {softcap}")
    return int(sliding_window or 0), float(softcap or 0.0)


def _sink_logits(sinks: torch.Tensor | None, num_q_heads: int) -> torch.Tensor | None:
    """Sink logits as the kernels read them: (num_q_heads,) contiguous float32 (None: no sinks)."""
    if sinks is None:
        return None
    if sinks.shape != (num_q_heads,):
        raise ValueError(f"sinks must hold one logit per query head ({num_q_heads},), got {tuple(sinks.shape)}")
    return sinks.detach().to(torch.float32).contiguous()


def _check_tables(block_tables: torch.Tensor, lengths: torch.Tensor, block_size: int, num_slots: int) -> None:
    """The C code trusts these: every row's keys lie inside its table, every table inside the cache."""
    if block_tables.shape[0] != lengths.shape[0]:
        raise ValueError("block_tables and lengths need one row per sequence")
    if int(lengths.max()) > block_tables.shape[1] * block_size:
        raise ValueError("a row is longer than its block table covers")
    if int(block_tables.min()) < 0 or (int(block_tables.max()) + 1) * block_size > num_slots:
        raise ValueError("a block table points outside the cache")


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, lengths: torch.Tensor, block_size: int,
                           scale: float, k_lut: torch.Tensor | None = None,
                           v_lut: torch.Tensor | None = None, sliding_window: int | None = None,
                           softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per row against its own keys, read in place from the paged cache.

    q: (B, Hkv, G, D) float32 or bfloat16 (a KV head's G query heads together); k_cache, v_cache:
    (slots, Hkv, D) float32, bfloat16 or FP8 (then k_lut, v_lut from fp8_lookup_table), contiguous,
    slot = block * block_size + offset; block_tables: (B, max_blocks) int32; lengths: (B,) int32, row b attends slots of tokens
    [0, lengths[b]), or with `sliding_window` W only its last W of them. `softcap` c: scores become
    c * tanh(score / c) before the softmax. `sinks` (Hkv * G,): a logit per query head (head h * G + g)
    that joins the softmax's denominator and weighs no value (gpt-oss's attention sinks, after any cap).
    Returns (B, Hkv, G, D).
    """
    lib = _LIBRARY.require()
    num_rows, num_kv_heads, group, head_dim = q.shape
    check_caches(q, k_cache, v_cache)
    if k_cache.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(f"caches hold (kv_heads, head_dim) {tuple(k_cache.shape[1:])}, q has {(num_kv_heads, head_dim)}")
    block_tables = block_tables.to(torch.int32).contiguous()
    lengths = lengths.to(torch.int32).contiguous()
    if not num_rows:
        return torch.empty_like(q)
    _check_tables(block_tables, lengths, block_size, k_cache.shape[0])
    luts = _lut_pointers(k_cache, k_lut, v_lut)
    sinks = _sink_logits(sinks, num_kv_heads * group)
    q = q.contiguous()
    out = torch.empty_like(q)
    rc = lib.paged_decode_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), *luts, lengths.data_ptr(),
                                    block_tables.data_ptr(), out.data_ptr(), num_rows, num_kv_heads, group,
                                    head_dim, block_size, block_tables.shape[1], scale, *_formats(q, k_cache),
                                    *_window_softcap(sliding_window, softcap),
                                    None if sinks is None else sinks.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise MemoryError("CPU decode-attention kernel: out of memory for its score rows")
    return out


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            token_starts: torch.Tensor, query_lens: torch.Tensor, context_lens: torch.Tensor,
                            block_tables: torch.Tensor, block_size: int, scale: float,
                            out: torch.Tensor, k_lut: torch.Tensor | None = None,
                            v_lut: torch.Tensor | None = None, sliding_window: int | None = None,
                            softcap: float | None = None, sinks: torch.Tensor | None = None) -> None:
    """Prefill chunks attend their cached context and themselves causally, keys read from the paged
    cache (this step's keys must be written there first): fresh prompts and prefix hits alike.

    q, out: (T, H, D) float32 or bfloat16, one dtype, with contiguous heads (q may be a view into a
    fused qkv output); per
    prefill sequence (int32): its first flat token, query length, context length and block table
    (S, max_blocks) covering context + queries. head_dim must be a multiple of 16. FP8 caches as for
    decode (k_lut, v_lut). `sliding_window` W: a query at position p sees keys at positions > p - W
    only; `softcap` and `sinks` (H,) as for decode.
    Writes the sequences' rows of `out`.
    """
    lib = _LIBRARY.require()
    num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
    check_caches(q, k_cache, v_cache)
    if out.dtype != q.dtype:
        raise TypeError(f"out must be in q's dtype {q.dtype}, got {out.dtype}")
    if head_dim % 16 or q.stride(2) != 1 or q.stride(1) != head_dim or out.stride(2) != 1 or out.stride(1) != head_dim:
        raise ValueError("q and out need contiguous (H, D) heads and head_dim a multiple of 16")
    token_starts, query_lens, context_lens, block_tables = (
        t.to(torch.int32).contiguous() for t in (token_starts, query_lens, context_lens, block_tables))
    num_seqs = query_lens.shape[0]
    if not num_seqs:
        return
    if int((token_starts + query_lens).max()) > q.shape[0]:
        raise ValueError("a sequence's queries run past the step's tokens")
    _check_tables(block_tables, context_lens + query_lens, block_size, k_cache.shape[0])
    luts = _lut_pointers(k_cache, k_lut, v_lut)
    sinks = _sink_logits(sinks, q.shape[1])
    rc = lib.paged_prefill_attention(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), *luts,
                                     out.data_ptr(), out.stride(0), token_starts.data_ptr(), query_lens.data_ptr(),
                                     context_lens.data_ptr(), block_tables.data_ptr(), num_seqs,
                                     block_tables.shape[1], num_kv_heads, q.shape[1] // num_kv_heads, head_dim,
                                     block_size, scale, *_formats(q, k_cache), *_window_softcap(sliding_window, softcap),
                                     None if sinks is None else sinks.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise MemoryError("CPU prefill-attention kernel: out of memory for its key and score buffers")
