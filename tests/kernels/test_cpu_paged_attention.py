"""The C paged-attention kernels (decode and prefill) against their float64 references
(kernels/reference.py) and SDPA, on blocks scattered through the cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchgen.kernels import cpu_paged_attention
from batchgen.kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref
from tests.kernels.helpers import fresh_library, scattered_paged_cache


def test_the_kernel_builds_here():
    assert cpu_paged_attention.is_available()  # CI has a C compiler; the engine would fall back to SDPA


@pytest.mark.parametrize("num_kv_heads,group,head_dim,block_size", [(3, 3, 64, 16), (2, 4, 32, 4), (1, 1, 16, 1)])
def test_matches_float64_reference_on_scattered_blocks(num_kv_heads, group, head_dim, block_size):
    lengths = [1, 5, 48, 17, 33, 2, 40, 16]  # block-aligned, one past, one short of a block
    k_cache, v_cache, tables, _, _ = scattered_paged_cache(lengths, num_kv_heads, head_dim, block_size, seed=0)
    q = torch.randn(len(lengths), num_kv_heads, group, head_dim)
    args = (q, k_cache, v_cache, tables, torch.tensor(lengths, dtype=torch.int32), block_size, head_dim ** -0.5)
    torch.testing.assert_close(cpu_paged_attention.paged_decode_attention(*args), paged_decode_attention_ref(*args),
                               rtol=1e-5, atol=1e-5)


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
    expected = out.clone()
    cpu_paged_attention.paged_prefill_attention(*args, out)
    paged_prefill_attention_ref(*args, expected)
    assert bool((out[:num_decode_rows] == 7.0).all())
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_prefill_refuses_head_dims_it_has_no_tiles_for():
    cache = torch.zeros(8, 1, 8)
    q = torch.zeros(2, 1, 8)
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu_paged_attention.paged_prefill_attention(
            q, cache, cache, torch.tensor([0], dtype=torch.int32), torch.tensor([2], dtype=torch.int32),
            torch.tensor([0], dtype=torch.int32), torch.tensor([[0]], dtype=torch.int32), 2, 1.0, torch.zeros_like(q))
