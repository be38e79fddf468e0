"""The Triton KV store against the torch reference, under TRITON_INTERPRET=1: it writes exactly the
slots it is given (slot -1 skipped, every other slot bit-for-bit untouched), from strided inputs,
and quantizes into FP8 caches (x / scale, clamped to the format's finite range)."""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels.reference import kv_store_reference
from batchgen.kernels.triton_kv_store import FP8_KV_MAX, store_kv
from tests.kernels.helpers import assert_within_one_fp8_step, bits

pytestmark = pytest.mark.triton


def sentinel_cache(num_slots: int, num_kv_heads: int, head_size: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((num_slots, num_kv_heads, head_size), float("nan")).to(dtype)


@pytest.mark.parametrize("dtype,num_kv_heads,head_size,slot_dtype", [
    (torch.float32, 5, 80, torch.int64),  # 5 heads: a padded head tile; 80: a padded head_size tile
    (torch.float16, 2, 128, torch.int32),
], ids=["fp32-h5-d80", "fp16-h2-d128"])
def test_writes_exactly_the_given_slots(dtype, num_kv_heads, head_size, slot_dtype):
    gen = torch.Generator().manual_seed(0)
    num_tokens, num_slots = 6, 48
    # key and value as views of a fused projection (T, (Hq + 2 Hkv) * D), as a model produces them.
    fused = torch.randn(num_tokens, (3 + 2 * num_kv_heads) * head_size, generator=gen).to(dtype)
    fused = fused.view(num_tokens, 3 + 2 * num_kv_heads, head_size)
    key, value = fused[:, 3:3 + num_kv_heads], fused[:, 3 + num_kv_heads:]
    slots = torch.tensor([17, -1, 0, 47, 33, -1], dtype=slot_dtype)  # scattered; -1 = padding
    k_cache = sentinel_cache(num_slots, num_kv_heads, head_size, dtype)
    v_cache = sentinel_cache(num_slots, num_kv_heads, head_size, dtype)
    expected_k, expected_v = kv_store_reference(key, value, k_cache, v_cache, slots)
    store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(bits(k_cache), bits(expected_k))
    assert torch.equal(bits(v_cache), bits(expected_v))
    written = slots[slots >= 0].long()
    assert not k_cache[written].isnan().any()
    untouched = torch.ones(num_slots, dtype=torch.bool)
    untouched[written] = False
    assert k_cache[untouched].isnan().all() and v_cache[untouched].isnan().all()


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3fn", "e5m2"])
def test_fp8_quantizes_with_scale_and_clamp(cache_dtype):
    gen = torch.Generator().manual_seed(1)
    num_tokens, num_kv_heads, head_size, num_slots = 5, 2, 64, 32
    key = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen) * 4
    value = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen) * 4
    k_scale, v_scale = torch.tensor([0.01]), torch.tensor([0.5])
    limit = FP8_KV_MAX[cache_dtype]
    key[0, 0, :4] = torch.tensor([1e9, -1e9, limit * 0.02, -limit * 0.011])  # past the range: clamped
    slots = torch.tensor([3, 30, -1, 12, 7])
    k_cache = sentinel_cache(num_slots, num_kv_heads, head_size, cache_dtype)
    v_cache = sentinel_cache(num_slots, num_kv_heads, head_size, cache_dtype)
    expected_k, expected_v = kv_store_reference(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    store_kv(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    for got, expected in ((k_cache, expected_k), (v_cache, expected_v)):
        assert_within_one_fp8_step(got, expected)
    assert k_cache[3, 0, :4].float().tolist() == [limit, -limit, limit, -limit]
    written = torch.zeros(num_slots, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    assert torch.equal(bits(k_cache[~written]), bits(expected_k[~written]))  # the NaN sentinels
    assert not k_cache[written].float().isnan().any()


def test_empty_step_writes_nothing():
    cache = sentinel_cache(4, 1, 64, torch.float32)
    empty = torch.empty(0, 1, 64)
    store_kv(empty, empty, cache, cache.clone(), torch.empty(0, dtype=torch.long))
    assert cache.isnan().all()


def test_wrapper_rejects_bad_inputs():
    key = torch.randn(2, 2, 64)
    cache = torch.zeros(8, 2, 64)
    slots = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(key, key, cache, cache, slots.float())
    with pytest.raises(ValueError, match="caches"):
        store_kv(key, key, torch.zeros(8, 1, 64), torch.zeros(8, 1, 64), slots)
    with pytest.raises(ValueError, match="dtype"):
        store_kv(key, key, cache.half(), cache.half(), slots)
    fp8 = cache.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="v_scale"):
        store_kv(key, key, fp8, fp8, slots, k_scale=torch.tensor([1.0]))
    with pytest.raises(ValueError, match="contiguous"):
        store_kv(key.transpose(1, 2).contiguous().transpose(1, 2), key, cache, cache, slots)
