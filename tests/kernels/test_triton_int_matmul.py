"""The Triton W4A16/W8A16 GEMM against its torch reference, under TRITON_INTERPRET=1 on the CPU.

float16/float32 only (the interpreter's bfloat16 tl.dot is not trustworthy) and small shapes: the
interpreter is slow. Odd K, N and M straddle every tile edge; zero points and act-order included.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel module is imported: jit reads it then

import pytest
import torch

from batchgen.kernels.reference import int_weight_matmul_ref
from batchgen.kernels.triton_int_matmul import int_weight_matmul, pack_codes
from batchgen.kernels.triton_tuning import gemm_candidates

pytestmark = pytest.mark.triton


def weight(n: int, k: int, bits: int, group_size: int, seed: int, act_order: bool = False,
           symmetric: bool = False):
    gen = torch.Generator().manual_seed(seed)
    num_groups = -(-k // group_size)
    codes = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.uint8)
    scales = torch.rand(n, num_groups, generator=gen) * 0.02 + 0.001
    zeros = torch.full((n, num_groups), float(1 << (bits - 1))) if symmetric else \
        torch.randint(0, 1 << bits, (n, num_groups), generator=gen).float()
    g_idx = None
    if act_order:  # each group keeps group_size columns, in shuffled positions
        g_idx = (torch.arange(k) // group_size)[torch.randperm(k, generator=gen)].to(torch.int32)
    return codes, scales, zeros, g_idx


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 3, 17, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_reference(bits, m, dtype):
    n, k, group_size = 40, 200, 64  # K not a multiple of the group (last group 8 columns) nor of BLOCK_K
    codes, scales, zeros, _ = weight(n, k, bits, group_size, seed=bits * 100 + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    out = int_weight_matmul(x, pack_codes(codes, bits), scales, zeros, bits, group_size)
    ref = int_weight_matmul_ref(x, codes, scales, zeros, group_size)
    assert out.dtype == dtype and out.shape == (m, n)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * ref.float().abs().max().item())


@pytest.mark.parametrize("bits", [4, 8])
def test_act_order_and_symmetric(bits):
    n, k, group_size = 24, 130, 32  # odd K: the 4-bit codes end in a half-filled byte
    for symmetric in (True, False):
        codes, scales, zeros, g_idx = weight(n, k, bits, group_size, seed=bits, act_order=True, symmetric=symmetric)
        x = torch.randn(5, k, generator=torch.Generator().manual_seed(5))
        out = int_weight_matmul(x, pack_codes(codes, bits), scales, zeros, bits, group_size, g_idx)
        ref = int_weight_matmul_ref(x, codes, scales, zeros, group_size, g_idx)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        # Ignoring g_idx must give a different answer: the test would see a kernel that drops it.
        wrong = int_weight_matmul_ref(x, codes, scales, zeros, group_size)
        assert not torch.allclose(out, wrong, rtol=1e-3, atol=1e-3)


def test_prefill_tiles():
    assert gemm_candidates(1, 96, "int4", torch.float32)[0] != gemm_candidates(70, 96, "int4", torch.float32)[0]
    codes, scales, zeros, _ = weight(48, 96, 4, 32, seed=9)
    x = torch.randn(70, 96, generator=torch.Generator().manual_seed(1))  # M > 64: the prefill tiles
    out = int_weight_matmul(x, pack_codes(codes, 4), scales, zeros, 4, 32)
    ref = int_weight_matmul_ref(x, codes, scales, zeros, 32)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_bad_arguments_are_refused():
    codes, scales, zeros, _ = weight(32, 64, 4, 32, seed=1)
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="codes"):
        int_weight_matmul(x, codes, scales, zeros, 4, 32)  # unpacked codes given as 4-bit
    with pytest.raises(ValueError, match="scales"):
        int_weight_matmul(x, pack_codes(codes, 4), scales.double(), zeros, 4, 32)
    with pytest.raises(ValueError, match="bits"):
        int_weight_matmul(x, pack_codes(codes, 4), scales, zeros, 3, 32)
    with pytest.raises(ValueError, match="g_idx"):
        int_weight_matmul(x, pack_codes(codes, 4), scales, zeros, 4, 32, torch.zeros(63, dtype=torch.int32))


def test_16_bit_tables_and_symmetric_without_zeros():
    # float16 scales and zeros (the engine's GPU layout: 4 side bytes per group), and zeros=None
    # meaning the symmetric midpoint; m = 1 and 17 straddle the decode and prefill tiles.
    for bits in (4, 8):
        codes, scales, zeros, _ = weight(40, 200, bits, 64, seed=bits + 50)
        scales = scales.half()
        for m in (1, 17):
            x = torch.randn(m, 200, generator=torch.Generator().manual_seed(m))
            out = int_weight_matmul(x, pack_codes(codes, bits), scales, zeros.half(), bits, 64)
            ref = int_weight_matmul_ref(x, codes, scales, zeros, 64)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
            mid = torch.full_like(zeros, float(1 << (bits - 1)))
            out = int_weight_matmul(x, pack_codes(codes, bits), scales, None, bits, 64)
            ref = int_weight_matmul_ref(x, codes, scales, mid, 64)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_the_engine_kernel_folds_float_minima_into_float_zeros():
    # GGUF Q4_1 (w = d * q + m per 32) through the engine's Triton layer: m becomes a float zero z - m / d.
    from batchgen.engine.quant.int_formats import IntWeight
    from batchgen.engine.quant.int_matmul_cuda import TritonIntKernel

    gen = torch.Generator().manual_seed(3)
    w = IntWeight(torch.randint(0, 16, (40, 96), generator=gen, dtype=torch.uint8),
                  (torch.rand(40, 3, generator=gen) * 0.02 + 0.001).half(), torch.zeros(40, 3, dtype=torch.int16),
                  group_size=32, bits=4, offsets=(-torch.rand(40, 3, generator=gen) * 0.1).half())
    assert TritonIntKernel.can_run(w)
    x = torch.randn(3, 96, generator=gen)
    ref = x @ w.dequantize().t()
    out = TritonIntKernel(w, torch.device("cpu"))(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
