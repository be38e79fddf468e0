"""The C paged-attention kernels (decode and prefill) against float64 references and SDPA, on blocks scattered through the cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchgen.kernels import cpu_paged_attention


def _paged(lengths: list[int], num_kv_heads: int, head_dim: int, block_size: int, seed: int):
    """Caches full of NaN except the rows' own tokens, in blocks scattered through the cache."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = [-(-n // block_size) for n in lengths]
    order = torch.randperm(sum(num_blocks) + 5, generator=gen).tolist()  # 5 blocks nobody owns
    tables, keys, values = [], [], []
    k_cache = torch.full(((sum(num_blocks) + 5) * block_size, num_kv_heads, head_dim), float("nan"))
    v_cache = k_cache.clone()
    for n, nb in zip(lengths, num_blocks):
        table = [order.pop() for _ in range(nb)]
        slots = torch.tensor([b * block_size + i for b in table for i in range(block_size)][:n])
        keys.append(torch.randn(n, num_kv_heads, head_dim, generator=gen) * 2)
        values.append(torch.randn(n, num_kv_heads, head_dim, generator=gen))
        k_cache[slots], v_cache[slots] = keys[-1], values[-1]
        tables.append(table + [0] * (max(num_blocks) - nb))
    return k_cache, v_cache, torch.tensor(tables, dtype=torch.int32), keys, values


def _reference(q, keys, values, scale):
    """float64: row b's group queries attend its own keys (n, Hkv, D)."""
    out = torch.empty_like(q, dtype=torch.float64)
    for b, (k, v) in enumerate(zip(keys, values)):
        scores = torch.einsum("hgd,lhd->hgl", q[b].double(), k.double()) * scale
        out[b] = torch.einsum("hgl,lhd->hgd", scores.softmax(-1), v.double())
    return out.float()


def test_the_kernel_builds_here():
    assert cpu_paged_attention.is_available()  # CI has a C compiler; the engine would fall back to SDPA


@pytest.mark.parametrize("num_kv_heads,group,head_dim,block_size", [(3, 3, 64, 16), (2, 4, 32, 4), (1, 1, 16, 1)])
def test_matches_float64_reference_on_scattered_blocks(num_kv_heads, group, head_dim, block_size):
    lengths = [1, 5, 48, 17, 33, 2, 40, 16]  # block-aligned, one past, one short of a block
    k_cache, v_cache, tables, keys, values = _paged(lengths, num_kv_heads, head_dim, block_size, seed=0)
    q = torch.randn(len(lengths), num_kv_heads, group, head_dim)
    scale = head_dim ** -0.5
    got = cpu_paged_attention.paged_decode_attention(
        q, k_cache, v_cache, tables, torch.tensor(lengths, dtype=torch.int32), block_size, scale)
    torch.testing.assert_close(got, _reference(q, keys, values, scale), rtol=1e-5, atol=1e-5)


def test_matches_sdpa_at_smollm_shapes():
    num_kv_heads, group, head_dim, block_size = 3, 3, 64, 16
    lengths = torch.randint(100, 300, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    k_cache, v_cache, tables, keys, values = _paged(lengths, num_kv_heads, head_dim, block_size, seed=1)
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


def test_without_a_compiler_it_is_unavailable_and_says_so(monkeypatch, tmp_path, caplog):
    library = cpu_paged_attention._LIBRARY
    monkeypatch.setattr(library, "_library", None)  # restored after the test, with _is_tried
    monkeypatch.setattr(library, "_is_tried", False)
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))  # nothing cached there
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
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


def _prefill_reference(q, keys, values, context_len, scale):
    """float64: q (Q, H, D); keys, values (C + Q, Hkv, D); query i sees keys [0, C + i]."""
    num_q, num_heads, _ = q.shape
    group = num_heads // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    allowed = torch.arange(k.shape[0])[None, :] <= (context_len + torch.arange(num_q))[:, None]
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v).float()


@pytest.mark.parametrize("num_kv_heads,group,head_dim,block_size", [(3, 3, 64, 16), (2, 4, 32, 4), (1, 2, 16, 5)])
@pytest.mark.parametrize("chunks", [
    [(37, 0), (1, 20), (16, 16), (50, 3)],  # (queries, cached context): fresh, one token left, aligned, short context
    [(300, 45)],  # one long chunk: its rows are split across the threads
])
def test_prefill_matches_float64_reference_with_and_without_context(num_kv_heads, group, head_dim, block_size, chunks):
    torch.manual_seed(0)
    lengths = [q + c for q, c in chunks]
    k_cache, v_cache, tables, keys, values = _paged(lengths, num_kv_heads, head_dim, block_size, seed=2)
    num_decode_rows = 3  # rows ahead of the chunks that the kernel must leave alone
    num_tokens = num_decode_rows + sum(q for q, _ in chunks)
    # q as the q block of a fused qkv output: rows strided by the whole qkv row.
    qkv = torch.randn(num_tokens, (group + 2) * num_kv_heads * head_dim)
    q = qkv[:, :group * num_kv_heads * head_dim].view(num_tokens, group * num_kv_heads, head_dim)
    out = torch.full((num_tokens, group * num_kv_heads, head_dim), 7.0)
    starts = [num_decode_rows + sum(n for n, _ in chunks[:i]) for i in range(len(chunks))]
    as_int = lambda values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
    scale = head_dim ** -0.5
    cpu_paged_attention.paged_prefill_attention(
        q, k_cache, v_cache, as_int(starts), as_int([n for n, _ in chunks]), as_int([c for _, c in chunks]),
        tables, block_size, scale, out)
    assert bool((out[:num_decode_rows] == 7.0).all())
    for (num_q, context), start, k, v in zip(chunks, starts, keys, values):
        expected = _prefill_reference(q[start:start + num_q], k, v, context, scale)
        torch.testing.assert_close(out[start:start + num_q], expected, rtol=1e-5, atol=1e-5)


def test_prefill_refuses_head_dims_it_has_no_tiles_for():
    cache = torch.zeros(8, 1, 8)
    q = torch.zeros(2, 1, 8)
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu_paged_attention.paged_prefill_attention(
            q, cache, cache, torch.tensor([0], dtype=torch.int32), torch.tensor([2], dtype=torch.int32),
            torch.tensor([0], dtype=torch.int32), torch.tensor([[0]], dtype=torch.int32), 2, 1.0, torch.zeros_like(q))


def test_store_kv_writes_strided_rows_into_their_slots_like_index_copy():
    torch.manual_seed(0)
    num_tokens, num_kv_heads, head_dim = 40, 3, 16  # 40 x 48 floats: split over both threads
    qkv = torch.randn(num_tokens, 5 * num_kv_heads * head_dim)
    k = qkv[:, 3 * 48:4 * 48].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, 4 * 48:].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(100)[:num_tokens]
    k_cache, v_cache = torch.randn(100, num_kv_heads, head_dim), torch.randn(100, num_kv_heads, head_dim)
    expected_k, expected_v = k_cache.clone().index_copy_(0, slots, k), v_cache.clone().index_copy_(0, slots, v)
    cpu_paged_attention.store_kv(k, v, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache, expected_k, rtol=0, atol=0)
    torch.testing.assert_close(v_cache, expected_v, rtol=0, atol=0)
    with pytest.raises(ValueError, match="outside the cache"):
        cpu_paged_attention.store_kv(k, v, k_cache, v_cache, slots + 100)
    # One token: its views' token strides differ (a size-1 dim's stride is arbitrary), the write must not.
    one_k, one_v = qkv[:1, 3 * 48:4 * 48].view(1, num_kv_heads, head_dim), v.contiguous()[:1]
    cpu_paged_attention.store_kv(one_k, one_v, k_cache, v_cache, slots[:1])
    assert torch.equal(k_cache[slots[0]], one_k[0]) and torch.equal(v_cache[slots[0]], one_v[0])
