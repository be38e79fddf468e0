"""The C paged-attention kernels (decode and prefill) against the float64 reference
(kernels/reference.py's paged_attention_reference, shared with the Triton kernel) and SDPA, on
blocks scattered through the cache; float32 and FP8 caches (read through the lookup table)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchgen.kernels import cpu_paged_attention
from batchgen.kernels.cpu_paged_attention import fp8_lookup_table
from batchgen.kernels.reference import paged_attention_reference, quantize_kv_reference
from tests.kernels.helpers import fresh_library, scattered_paged_cache


def test_the_kernel_builds_here():
    assert cpu_paged_attention.is_available()  # CI has a C compiler; the engine would fall back to SDPA


@pytest.mark.parametrize("num_kv_heads,group,head_dim,block_size",
                         [(3, 3, 64, 16), (2, 4, 32, 4), (1, 1, 16, 1), (2, 2, 128, 16), (1, 3, 48, 8)])
def test_matches_float64_reference_on_scattered_blocks(num_kv_heads, group, head_dim, block_size):
    lengths = [1, 5, 48, 17, 33, 2, 40, 16]  # block-aligned, one past, one short of a block
    k_cache, v_cache, tables, _, _ = scattered_paged_cache(lengths, num_kv_heads, head_dim, block_size, seed=0)
    q = torch.randn(len(lengths), num_kv_heads, group, head_dim)
    lengths = torch.tensor(lengths, dtype=torch.int32)
    got = cpu_paged_attention.paged_decode_attention(q, k_cache, v_cache, tables, lengths, block_size,
                                                     head_dim ** -0.5)
    torch.testing.assert_close(got, decode_reference(q, k_cache, v_cache, tables, lengths, block_size),
                               rtol=1e-5, atol=1e-5)


def decode_reference(q, k_cache, v_cache, tables, lengths, block_size, k_scale=None, v_scale=None):
    """The shared reference on decode rows: q (B, Hkv, G, D) as B one-query sequences."""
    num_rows, num_kv_heads, group, head_dim = q.shape
    cu = torch.arange(num_rows + 1, dtype=torch.int32)
    out = paged_attention_reference(q.reshape(num_rows, num_kv_heads * group, head_dim), k_cache, v_cache,
                                    tables, cu, lengths, head_dim ** -0.5, block_size, k_scale, v_scale)
    return out.view(q.shape)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_fp8_cache_decode_and_prefill_match_reference_over_dequantized_cache(cache_dtype):
    """FP8 caches are read through the 256-entry table (value * scale): the reference attends the
    dequantized cache, so the only differences are float32 rounding. Without the scale applied the
    result would be far off (checked)."""
    num_kv_heads, group, head_dim, block_size = 3, 3, 64, 16
    lengths = [1, 17, 40, 33]
    k32, v32, tables, _, _ = scattered_paged_cache(lengths, num_kv_heads, head_dim, block_size, seed=5)
    k_scale, v_scale = torch.tensor(0.02), torch.tensor(0.05)
    k_cache = quantize_kv_reference(k32.nan_to_num(0.0), cache_dtype, k_scale)
    v_cache = quantize_kv_reference(v32.nan_to_num(0.0), cache_dtype, v_scale)
    k_lut, v_lut = fp8_lookup_table(cache_dtype, k_scale), fp8_lookup_table(cache_dtype, v_scale)
    q = torch.randn(len(lengths), num_kv_heads, group, head_dim, generator=torch.Generator().manual_seed(6))
    lens = torch.tensor(lengths, dtype=torch.int32)
    got = cpu_paged_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, block_size,
                                                     head_dim ** -0.5, k_lut, v_lut)
    expected = decode_reference(q, k_cache, v_cache, tables, lens, block_size, k_scale, v_scale)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    unscaled = cpu_paged_attention.paged_decode_attention(
        q, k_cache, v_cache, tables, lens, block_size, head_dim ** -0.5,
        fp8_lookup_table(cache_dtype, torch.tensor(1.0)), fp8_lookup_table(cache_dtype, torch.tensor(1.0)))
    assert (unscaled - got).abs().max() > 1.0
    # Prefill: the same rows as chunks (queries 1, 9, 20, 33 over contexts 0, 8, 20, 0).
    query_lens = [1, 9, 20, 33]
    num_tokens = sum(query_lens)
    q_flat = torch.randn(num_tokens, num_kv_heads * group, head_dim, generator=torch.Generator().manual_seed(7))
    starts = torch.tensor([0, 1, 10, 30], dtype=torch.int32)
    contexts = torch.tensor([n - m for n, m in zip(lengths, query_lens)], dtype=torch.int32)
    out = torch.empty_like(q_flat)
    cpu_paged_attention.paged_prefill_attention(q_flat, k_cache, v_cache, starts, torch.tensor(query_lens, dtype=torch.int32),
                                                contexts, tables, block_size, head_dim ** -0.5, out, k_lut, v_lut)
    cu = torch.tensor([0, 1, 10, 30, 63], dtype=torch.int32)
    expected = paged_attention_reference(q_flat, k_cache, v_cache, tables, cu, lens, head_dim ** -0.5, block_size,
                                         k_scale, v_scale)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="k_lut and v_lut"):
        cpu_paged_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, block_size, 0.1)


def test_matches_sdpa_at_smollm_shapes():
    num_kv_heads, group, head_dim, block_size = 3, 3, 64, 16
    lengths = torch.randint(100, 300, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    k_cache, v_cache, tables, keys, values = scattered_paged_cache(lengths, num_kv_heads, head_dim, block_size, seed=1)
    q = torch.randn(len(lengths), num_kv_heads, group, head_dim)
    got = cpu_paged_attention.paged_decode_attention(
        q, k_cache, v_cache, tables, torch.tensor(lengths, dtype=torch.int32), block_size, head_dim ** -0.5)
    for b, (k, v) in enumerate(zip(keys, values)):  # SDPA per row: (Hkv, G, D) queries, (Hkv, n, D) keys
        expected = F.scaled_dot_product_attention(q[b], k.transpose(0, 1), v.transpose(0, 1))
        torch.testing.assert_close(got[b], expected, rtol=1e-5, atol=1e-5)


def test_refuses_tables_that_do_not_cover_the_rows_or_leave_the_cache():
    cache = torch.zeros(4 * 2, 1, 8)  # 4 blocks of 2 slots
    q = torch.randn(2, 1, 1, 8)
    run = cpu_paged_attention.paged_decode_attention
    with pytest.raises(ValueError, match="longer than its block table"):
        run(q, cache, cache, torch.tensor([[0], [1]], dtype=torch.int32), torch.tensor([2, 3], dtype=torch.int32), 2, 1.0)
    with pytest.raises(ValueError, match="outside the cache"):
        run(q, cache, cache, torch.tensor([[0], [4]], dtype=torch.int32), torch.tensor([2, 2], dtype=torch.int32), 2, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        run(q, cache[::2], cache[::2], torch.tensor([[0], [1]], dtype=torch.int32), torch.tensor([1, 1], dtype=torch.int32), 2, 1.0)


def test_without_a_compiler_it_is_unavailable_and_says_so(monkeypatch, cache_root, caplog):
    monkeypatch.setattr(cpu_paged_attention, "_LIBRARY", fresh_library(cpu_paged_attention._LIBRARY))
    monkeypatch.setenv("CC", str(cache_root / "no-such-compiler"))  # and nothing cached there
    with caplog.at_level("WARNING", logger="batchgen.kernels"):
        assert not cpu_paged_attention.is_available()
    assert "attention runs through SDPA" in caplog.text
    with pytest.raises(RuntimeError, match="not available"):
        cpu_paged_attention.paged_decode_attention(
            torch.zeros(1, 1, 1, 4), torch.zeros(2, 1, 4), torch.zeros(2, 1, 4),
            torch.zeros(1, 1, dtype=torch.int32), torch.tensor([1], dtype=torch.int32), 2, 1.0)


def test_loading_the_kernel_leaves_denormals_alone():
    """The library is linked without -ffast-math: GCC's crtfastmath would switch this thread to
    flush-to-zero when it is loaded."""
    assert cpu_paged_attention.is_available()
    tiny = torch.tensor([1e-39], dtype=torch.float32)  # a float32 denormal
    assert (tiny * 1.0).item() != 0.0


@pytest.mark.parametrize("num_kv_heads,group,head_dim,block_size", [(3, 3, 64, 16), (2, 4, 32, 4), (1, 2, 16, 5)])
@pytest.mark.parametrize("chunks", [
    [(37, 0), (1, 20), (16, 16), (50, 3)],  # (queries, cached context): fresh, one token left, aligned, short context
    [(300, 45)],  # one long chunk: its rows are split across the threads
])
def test_prefill_matches_float64_reference_with_and_without_context(num_kv_heads, group, head_dim, block_size, chunks):
    torch.manual_seed(0)
    lengths = [q + c for q, c in chunks]
    k_cache, v_cache, tables, _, _ = scattered_paged_cache(lengths, num_kv_heads, head_dim, block_size, seed=2)
    num_decode_rows = 3  # rows ahead of the chunks that the kernel must leave alone
    num_tokens = num_decode_rows + sum(q for q, _ in chunks)
    # q as the q block of a fused qkv output: rows strided by the whole qkv row.
    qkv = torch.randn(num_tokens, (group + 2) * num_kv_heads * head_dim)
    q = qkv[:, :group * num_kv_heads * head_dim].view(num_tokens, group * num_kv_heads, head_dim)
    out = torch.full((num_tokens, group * num_kv_heads, head_dim), 7.0)
    starts = [num_decode_rows + sum(n for n, _ in chunks[:i]) for i in range(len(chunks))]
    as_int = lambda values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
    scale = head_dim ** -0.5
    args = (q, k_cache, v_cache, as_int(starts), as_int([n for n, _ in chunks]), as_int([c for _, c in chunks]),
            tables, block_size, scale)
    cpu_paged_attention.paged_prefill_attention(*args, out)
    # The reference over the chunks alone (its query offsets start at 0).
    cu = torch.tensor([0] + [n for n, _ in chunks]).cumsum(0).to(torch.int32)
    expected = paged_attention_reference(q[num_decode_rows:], k_cache, v_cache, tables, cu, as_int(lengths),
                                         scale, block_size)
    assert bool((out[:num_decode_rows] == 7.0).all())
    torch.testing.assert_close(out[num_decode_rows:], expected, rtol=1e-5, atol=1e-5)


def test_prefill_refuses_head_dims_it_has_no_tiles_for():
    cache = torch.zeros(8, 1, 8)
    q = torch.zeros(2, 1, 8)
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu_paged_attention.paged_prefill_attention(
            q, cache, cache, torch.tensor([0], dtype=torch.int32), torch.tensor([2], dtype=torch.int32),
            torch.tensor([0], dtype=torch.int32), torch.tensor([[0]], dtype=torch.int32), 2, 1.0, torch.zeros_like(q))
