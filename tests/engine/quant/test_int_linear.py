"""IntLinear and the CPU weight-only kernels against the dequantized float reference.

Odd shapes (K not a multiple of the group, N not a multiple of 16 where a kernel allows it),
M = 1, 3, 17, 64, zero points and act-order; each kernel pinned in turn, and the plan the layer
picks by itself.
"""

from __future__ import annotations

import pytest
import torch

from batchgen.engine.quant.int_formats import IntWeight, quantize_int4_groups, quantize_int8_per_channel
from batchgen.engine.quant.int_linear import IntLinear
from batchgen.engine.quant.int_matmul_cpu import CPU_KERNELS


def random_weight(n: int, k: int, bits: int, group_size: int, *, symmetric: bool, act_order: bool,
                  seed: int) -> IntWeight:
    gen = torch.Generator().manual_seed(seed)
    num_groups = -(-k // group_size)
    codes = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(n, num_groups, generator=gen) * 0.02 + 0.001).half()
    zeros = None if symmetric else torch.randint(0, 1 << bits, (n, num_groups), generator=gen, dtype=torch.int16)
    g_idx = None
    if act_order:
        g_idx = (torch.arange(k) // group_size)[torch.randperm(k, generator=gen)].to(torch.int32)
    return IntWeight(codes, scales, zeros, group_size=group_size, bits=bits, g_idx=g_idx)


CASES = [  # (bits, N, K, group_size, symmetric, act_order)
    (8, 48, 200, 200, True, False),  # int8 per channel, symmetric: torch's int8 kernel
    (8, 48, 200, 200, False, False),  # per-channel zero points: the int8 kernel's correction term
    (8, 40, 200, 64, False, True),  # 8-bit groups, act-order
    (4, 48, 200, 64, False, False),  # K = 200: short last group (int4 kernel pads K)
    (4, 48, 256, 128, True, True),  # act-order, symmetric: the int4 kernel permutes x
    (4, 40, 130, 32, False, False),  # N not a multiple of 16, odd K: dequant only
    (4, 32, 192, 192, False, False),  # one group per channel
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"int{c[0]}-{c[1]}x{c[2]}-g{c[3]}"
                         f"{'-sym' if c[4] else ''}{'-act' if c[5] else ''}")
@pytest.mark.parametrize("m", [1, 3, 17, 64])
def test_every_kernel_matches_the_dequantized_reference(case, m):
    bits, n, k, group_size, symmetric, act_order = case
    w = random_weight(n, k, bits, group_size, symmetric=symmetric, act_order=act_order, seed=m + n + k)
    assert w.is_act_order == act_order and w.is_symmetric == symmetric
    bias = torch.randn(n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    ref = x @ w.dequantize().t() + bias
    names = [name for name, kernel in CPU_KERNELS.items() if kernel.can_run(w)]
    assert "dequant" in names
    for name in names:
        out = IntLinear(w, bias, kernel=name)(x)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item(), msg=name)
    out = IntLinear(w, bias)(x)  # the plan picked at construction
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_kernel_availability_follows_the_layout():
    sym8 = quantize_int8_per_channel(torch.randn(32, 64))
    assert CPU_KERNELS["int8pack"].can_run(sym8) and not CPU_KERNELS["int4pack"].can_run(sym8)
    odd_n = quantize_int4_groups(torch.randn(40, 256))
    assert not CPU_KERNELS["int4pack"].can_run(odd_n)  # torch's int4 kernel needs N % 16 == 0
    g16 = quantize_int4_groups(torch.randn(32, 256), group_size=16)
    assert not CPU_KERNELS["int4pack"].can_run(g16)  # and groups of 32, 64, 128 or 256
    with pytest.raises(ValueError, match="int4pack"):
        IntLinear(g16, kernel="int4pack")


def test_leading_dims_bias_and_bytes():
    linear = torch.nn.Linear(300, 64)
    w = quantize_int4_groups(linear.weight)
    layer = IntLinear(w, linear.bias)
    x = torch.randn(2, 5, 300)
    torch.testing.assert_close(layer(x), x @ w.dequantize().t() + linear.bias.detach(), rtol=1e-4, atol=1e-4)
    float_bytes = 64 * 300 * 4
    assert layer.num_weight_bytes() < float_bytes / 2  # int4 codes + scales, well under float32
    assert "int4 group 128" in repr(layer)


def test_int8_at_load_is_close_to_the_float_layer():
    linear = torch.nn.Linear(512, 96, bias=False)
    x = torch.randn(17, 512)
    ref = linear(x).detach()
    out = IntLinear(quantize_int8_per_channel(linear.weight))(x)
    assert ((out - ref).norm() / ref.norm()) < 5e-3


@pytest.mark.parametrize("m", [1, 17])
def test_float_minima_through_every_kernel(m):
    # GGUF Q4_1: w = d * q + m per block of 32 (zero 0, float minima); N = 48 lets torch's int4 kernel run too.
    gen = torch.Generator().manual_seed(m)
    codes = torch.randint(0, 16, (48, 96), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(48, 3, generator=gen) * 0.02 + 0.001).half()
    minima = (-torch.rand(48, 3, generator=gen) * 0.1).half()
    w = IntWeight(codes, scales, torch.zeros(48, 3, dtype=torch.int16), group_size=32, bits=4, offsets=minima)
    x = torch.randn(m, 96, generator=gen)
    ref = x @ w.dequantize().t()
    names = [name for name, kernel in CPU_KERNELS.items() if kernel.can_run(w)]
    assert names == ["int4pack", "dequant"]
    for name in names:
        torch.testing.assert_close(IntLinear(w, kernel=name)(x), ref, rtol=1e-4,
                                   atol=1e-4 * ref.abs().max().item(), msg=name)


def test_one_copy_of_the_weight_per_layer():
    # int8: torch's kernel (M = 1) and the dequant kernel (M > 1) read the same int8 codes and scales.
    w8 = quantize_int8_per_channel(torch.randn(64, 256))
    layer = IntLinear(w8)
    assert layer.kernel_names == ["int8pack", "dequant"]
    assert layer.num_weight_bytes() == 64 * 256 + 64 * 4
    w4 = quantize_int4_groups(torch.randn(64, 256))
    assert IntLinear(w4).kernel_names == ["dequant"]
    assert IntLinear(w4).num_weight_bytes() == 64 * 128 + 2 * 64 * 2 * 4  # nibbles + float32 scale and -z*s
