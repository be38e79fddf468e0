"""The C kernels on bfloat16: the KV store rounding into a bf16 cache, decode and prefill attention over
a bf16 cache (float32 or bf16 queries) against the float64 reference over that same cache (on BF16
units, bf16 queries: the reference with bf16 probabilities, within that rounding's bound of the exact
one), and the elementwise ops in bf16 against the eager bf16 ops (kernels/reference.py)."""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels import cpu_elementwise, cpu_kv_store, cpu_paged_attention
from batchgen.kernels.reference import (
    add_rms_norm_ref,
    kv_store_reference,
    paged_attention_reference,
    rms_norm_ref,
    rotary_ref,
    silu_mul_ref,
)
from tests.kernels.helpers import rotary_tables, scattered_paged_cache

BF16 = torch.bfloat16


def assert_within_bf16_steps(got: torch.Tensor, expected: torch.Tensor, steps: float = 1.0) -> None:
    """got within `steps` bfloat16 steps of expected: a step is the spacing of bf16 values near
    expected, at most 2^-7 of it (8 significant bits); rounding to nearest is off by half a step."""
    got, expected = got.double(), expected.double()
    limit = steps * (expected.abs() * 2.0 ** -7 + 1e-6)
    worst = ((got - expected).abs() - limit).max().item()
    assert worst <= 0, f"off by more than {steps} bf16 steps (worst excess {worst:.3g})"


def test_float32_keys_are_rounded_into_a_bf16_cache_like_torch_and_bf16_keys_copied():
    gen = torch.Generator().manual_seed(0)
    num_tokens, num_kv_heads, head_dim = 40, 3, 64  # 40 x 192 values: split over both threads
    qkv = torch.randn(num_tokens, 5 * num_kv_heads * head_dim, generator=gen) * 5
    k = qkv[:, 3 * 192:4 * 192].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, 4 * 192:].view(num_tokens, num_kv_heads, head_dim)
    # Ties and specials: exactly halfway between two bf16 values (round to even, up and down), inf, NaN.
    k[0, 0, :4] = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, float("inf"), float("nan")])
    slots = torch.randperm(100, generator=gen)[:num_tokens]
    k_cache, v_cache = torch.zeros(100, num_kv_heads, head_dim, dtype=BF16), torch.zeros(100, num_kv_heads, head_dim,
                                                                                           dtype=BF16)
    expected_k, expected_v = kv_store_reference(k, v, k_cache, v_cache, slots)
    cpu_kv_store.store_kv(k, v, k_cache, v_cache, slots)
    # Bit for bit, except that a NaN's payload differs between torch's own conversion paths: NaN stays NaN.
    is_nan = expected_k.isnan()
    assert torch.equal(k_cache.isnan(), is_nan) and int(is_nan.sum()) == 1
    assert torch.equal(k_cache.view(torch.int16)[~is_nan], expected_k.view(torch.int16)[~is_nan])
    assert torch.equal(v_cache.view(torch.int16), expected_v.view(torch.int16))
    assert k_cache[slots[0], 0, :3].tolist() == [1.0, 1 + 2 ** -6, float("inf")]
    # bf16 keys (the model computing in bf16) are copied as they are.
    k16, v16 = k.to(BF16), v.to(BF16)
    other_k, other_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    cpu_kv_store.store_kv(k16, v16, other_k, other_v, slots)
    assert torch.equal(other_k[slots].view(torch.int16), k16.view(torch.int16))
    assert torch.equal(other_v[slots].view(torch.int16), v16.view(torch.int16))
    with pytest.raises(TypeError, match="not a float32 one"):
        cpu_kv_store.store_kv(k16, v16, torch.zeros(100, 3, 64), torch.zeros(100, 3, 64), slots)


def bf16_paged_cache(lengths, num_kv_heads, head_dim, block_size, seed):
    """scattered_paged_cache's layout in bfloat16 (unowned slots keep NaN: a read of them would show)."""
    k32, v32, tables, _, _ = scattered_paged_cache(lengths, num_kv_heads, head_dim, block_size, seed)
    return k32.to(BF16), v32.to(BF16), tables


def rounded_probabilities_reference(q, k_cache, v_cache, tables, lengths, block_size, scale):
    """Decode in float64 with the softmax's probabilities rounded to bfloat16 before P V (what the
    BF16-unit kernel computes), and each output's bound on how far that rounding moves it from the
    exact result: half a bf16 step of each p, 2^-9 x sum_t p_t |v_t| (twice that here, for margin)."""
    expected, bound = torch.empty(q.shape, dtype=torch.float64), torch.empty(q.shape, dtype=torch.float64)
    for b, length in enumerate(lengths):
        slots = (tables[b].long()[:, None] * block_size + torch.arange(block_size)).flatten()[:length]
        keys, values = k_cache[slots].double(), v_cache[slots].double()  # (L, Hkv, D)
        for h in range(q.shape[1]):
            p = torch.softmax(q[b, h].double() @ keys[:, h].T * scale, dim=-1)  # (G, L)
            expected[b, h] = p.to(BF16).double() @ values[:, h]
            bound[b, h] = 2.0 ** -8 * (p @ values[:, h].abs())
    return expected, bound


@pytest.mark.parametrize("num_kv_heads,group,head_dim,block_size", [(3, 3, 64, 16), (2, 4, 32, 5), (2, 3, 128, 8)])
def test_decode_over_a_bf16_cache_matches_float64_reference_for_float32_and_bf16_queries(
        num_kv_heads, group, head_dim, block_size):
    lengths = [1, 5, 48, 17, 33, 2, 40, 16]
    k_cache, v_cache, tables = bf16_paged_cache(lengths, num_kv_heads, head_dim, block_size, seed=3)
    lens = torch.tensor(lengths, dtype=torch.int32)
    q = torch.randn(len(lengths), num_kv_heads, group, head_dim, generator=torch.Generator().manual_seed(4))
    cu = torch.arange(len(lengths) + 1, dtype=torch.int32)

    def reference(queries):
        flat = queries.reshape(len(lengths), num_kv_heads * group, head_dim).double()
        out = paged_attention_reference(flat, k_cache, v_cache, tables, cu, lens, head_dim ** -0.5, block_size)
        return out.view(q.shape)

    got = cpu_paged_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, block_size, head_dim ** -0.5)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), reference(q), rtol=1e-5, atol=1e-5)
    q16 = q.to(BF16)
    got16 = cpu_paged_attention.paged_decode_attention(q16, k_cache, v_cache, tables, lens, block_size,
                                                       head_dim ** -0.5)
    assert got16.dtype == BF16
    exact = reference(q16)
    if not cpu_paged_attention.decode_rounds_probabilities(head_dim, block_size):
        assert_within_bf16_steps(got16, exact)  # float32 inside, one rounding at the end
        return
    # BF16 units: one rounding at the end of the computation with bf16 probabilities, and within the
    # rounding's bound of the exact result (a kernel that dropped or misordered a pair would not be).
    expected, bound = rounded_probabilities_reference(q16, k_cache, v_cache, tables, lengths, block_size,
                                                      head_dim ** -0.5)
    assert_within_bf16_steps(got16, expected)
    limit = bound + exact.abs() * 2.0 ** -7 + 1e-6
    assert ((got16.double() - exact).abs() <= limit).all()
    assert not ((expected - exact).abs() <= 1e-12).all()  # the rounding is there to be modelled


@pytest.mark.parametrize("chunks", [[(37, 0), (1, 20), (16, 16), (50, 3)], [(150, 45)]])
def test_prefill_over_a_bf16_cache_matches_float64_reference_for_float32_and_bf16_queries(chunks):
    num_kv_heads, group, head_dim, block_size = 3, 3, 64, 16
    lengths = [q + c for q, c in chunks]
    k_cache, v_cache, tables = bf16_paged_cache(lengths, num_kv_heads, head_dim, block_size, seed=5)
    num_tokens = sum(q for q, _ in chunks)

    def as_int(values):
        return torch.tensor(values, dtype=torch.int32)
    starts = as_int([sum(n for n, _ in chunks[:i]) for i in range(len(chunks))])
    query_lens, contexts = as_int([n for n, _ in chunks]), as_int([c for _, c in chunks])
    cu = torch.tensor([0] + [n for n, _ in chunks]).cumsum(0).to(torch.int32)
    qkv = torch.randn(num_tokens, (group + 2) * num_kv_heads * head_dim, generator=torch.Generator().manual_seed(6))
    for dtype in (torch.float32, BF16):  # q as the strided q block of a fused qkv output
        q = qkv.to(dtype)[:, :group * num_kv_heads * head_dim].view(num_tokens, group * num_kv_heads, head_dim)
        out = torch.full(q.shape, 7.0, dtype=dtype)
        cpu_paged_attention.paged_prefill_attention(q, k_cache, v_cache, starts, query_lens, contexts, tables,
                                                    block_size, head_dim ** -0.5, out)
        expected = paged_attention_reference(q.double(), k_cache, v_cache, tables, cu, as_int(lengths),
                                             head_dim ** -0.5, block_size)
        if dtype == torch.float32:
            torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
        else:
            assert_within_bf16_steps(out, expected)


def test_elementwise_ops_in_bf16_match_the_eager_bf16_ops():
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(333, 576, generator=gen) * 3).to(BF16)  # 333 x 576: both threads
    residual = torch.randn(333, 576, generator=gen).to(BF16)
    weight = torch.randn(576, generator=gen).to(BF16)
    expected_normed, expected_total = add_rms_norm_ref(x, residual, weight, 1e-5)
    normed, total = cpu_elementwise.add_rms_norm(x, residual.clone(), weight, 1e-5)
    assert torch.equal(total, expected_total)  # one rounding of the float32 sum, as torch's bf16 add
    assert_within_bf16_steps(normed, expected_normed)
    assert_within_bf16_steps(cpu_elementwise.rms_norm(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5))
    gate_up = (torch.randn(300, 2 * 1536, generator=gen) * 4).to(BF16)
    # Both round silu(gate), then the product: each within a step of the other's roundings.
    assert_within_bf16_steps(cpu_elementwise.silu_mul(gate_up), silu_mul_ref(gate_up), steps=2)
    num_heads, head_dim = 12, 64
    _, _, cos, signed_sin = rotary_tables(torch.randint(0, 512, (37,), generator=gen), head_dim)
    cos, signed_sin = cos.to(BF16), signed_sin.to(BF16)
    qk = torch.randn(37, num_heads, head_dim, generator=gen).to(BF16)
    expected = rotary_ref(qk.double(), cos.double(), signed_sin.double())  # the exact value of the bf16 inputs
    assert_within_bf16_steps(cpu_elementwise.rotary(qk, cos, signed_sin), expected, steps=0.5)  # rounded once
    with pytest.raises(ValueError, match="one dtype"):
        cpu_elementwise.rms_norm(x, weight.float(), 1e-5)
