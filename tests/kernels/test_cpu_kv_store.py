"""The C cache write against the shared reference (kernels/reference.py's kv_store_reference), bit for
bit, from strided views of a qkv output; into float32 and FP8 caches."""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels import cpu_kv_store
from batchgen.kernels.reference import kv_store_reference


def test_store_kv_writes_strided_rows_into_their_slots_like_the_reference():
    torch.manual_seed(0)
    num_tokens, num_kv_heads, head_dim = 40, 3, 16  # 40 x 48 floats: split over both threads
    qkv = torch.randn(num_tokens, 5 * num_kv_heads * head_dim)
    k = qkv[:, 3 * 48:4 * 48].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, 4 * 48:].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(100)[:num_tokens]
    k_cache, v_cache = torch.randn(100, num_kv_heads, head_dim), torch.randn(100, num_kv_heads, head_dim)
    expected_k, expected_v = kv_store_reference(k, v, k_cache, v_cache, slots)
    cpu_kv_store.store_kv(k, v, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache, expected_k, rtol=0, atol=0)
    torch.testing.assert_close(v_cache, expected_v, rtol=0, atol=0)
    with pytest.raises(ValueError, match="outside the cache"):
        cpu_kv_store.store_kv(k, v, k_cache, v_cache, slots + 100)
    # One token: its views' token strides differ (a size-1 dim's stride is arbitrary), the write must not.
    one_k, one_v = qkv[:1, 3 * 48:4 * 48].view(1, num_kv_heads, head_dim), v.contiguous()[:1]
    cpu_kv_store.store_kv(one_k, one_v, k_cache, v_cache, slots[:1])
    assert torch.equal(k_cache[slots[0]], one_k[0]) and torch.equal(v_cache[slots[0]], one_v[0])


def test_store_kv_refuses_what_the_caches_do_not_hold():
    cache = torch.zeros(8, 2, 16)
    rows = torch.zeros(3, 2, 16)
    with pytest.raises(TypeError, match="float32"):
        cpu_kv_store.store_kv(rows.double(), rows.double(), cache, cache, torch.arange(3))
    with pytest.raises(ValueError, match=r"\(Hkv, D\) rows"):
        cpu_kv_store.store_kv(torch.zeros(3, 1, 16), torch.zeros(3, 1, 16), cache, cache, torch.arange(3))
    with pytest.raises(ValueError, match="contiguous"):
        cpu_kv_store.store_kv(rows, rows, cache[::2], cache[::2], torch.arange(3))


def test_store_kv_quantizes_into_fp8_caches_like_the_reference():
    """clamp(x / scale) cast to FP8 (torch's cast: exact, unlike the Triton interpreter's), at the given
    slots only; values past the format's range are clamped to its largest finite value."""
    gen = torch.Generator().manual_seed(1)
    num_tokens, num_kv_heads, head_dim = 6, 2, 16
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * 3
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    k[0, 0, 0] = 1e6  # far past 448 * scale: clamped, not NaN
    k_scale, v_scale = torch.tensor(0.01), torch.tensor(0.5)
    slots = torch.tensor([9, 2, 30, 17, 0, 5])
    k_cache = torch.zeros(32, num_kv_heads, head_dim, dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros(32, num_kv_heads, head_dim, dtype=torch.float8_e4m3fn)
    expected_k, expected_v = kv_store_reference(k, v, k_cache, v_cache, slots, k_scale, v_scale)
    cpu_kv_store.store_kv(k, v, k_cache, v_cache, slots, k_scale, v_scale)
    assert torch.equal(k_cache.view(torch.uint8), expected_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), expected_v.view(torch.uint8))
    assert k_cache[9, 0, 0].float().item() == 448.0
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        cpu_kv_store.store_kv(k, v, k_cache, v_cache, slots)
