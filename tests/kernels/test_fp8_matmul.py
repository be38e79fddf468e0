"""The weight-only FP8 Triton matmul against its torch reference, under TRITON_INTERPRET=1 on the CPU.

Small float16/float32 shapes only: the interpreter's tl.dot on bfloat16 returns garbage (an
interpreter limit, not the kernel's), and it is slow.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel module is imported: jit reads it then

import pytest
import torch

from batchgen.kernels.fp8_matmul import fp8_w8a16_matmul
from batchgen.kernels.reference import fp8_w8a16_matmul_ref
from batchgen.kernels.triton_tuning import GemmTiles

pytestmark = pytest.mark.triton


def quantized(n: int, k: int, per_channel: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * (torch.rand(n, 1, generator=gen) + 0.1)
    amax = w.abs().amax(dim=1) if per_channel else w.abs().amax().reshape(1)
    scale = amax / 448.0
    q = (w / scale.reshape(-1, 1)).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scale.float().contiguous()


# Odd sizes straddle the block edges: masks on M, N and K all matter. M picks the tiles
# (kernels/triton_tuning.py): 1 and 5 the decode tiles, 17 the middle ones, 70 the prefill ones.
@pytest.mark.parametrize("m, n, k", [(1, 64, 64), (5, 70, 96), (17, 33, 130), (70, 40, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("per_channel", [True, False])
def test_matches_reference(m, n, k, dtype, per_channel):
    q, scale = quantized(n, k, per_channel, seed=m + n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(dtype)
    out = fp8_w8a16_matmul(x, q, scale)
    ref = fp8_w8a16_matmul_ref(x, q, scale)
    assert out.dtype == dtype and out.shape == (m, n)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * ref.float().abs().max().item())


def test_strided_input():
    q, scale = quantized(48, 64, True, seed=0)
    x = torch.randn(64, 9).t()  # (9, 64) with strides (1, 9): not row-major
    torch.testing.assert_close(fp8_w8a16_matmul(x, q, scale), fp8_w8a16_matmul_ref(x, q, scale),
                               rtol=1e-5, atol=1e-5)


def test_bad_arguments_are_refused():
    q, scale = quantized(32, 64, True, seed=1)
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_w8a16_matmul(x, q.float(), scale)
    with pytest.raises(ValueError, match=r"x \(M, K\)"):
        fp8_w8a16_matmul(torch.randn(4, 63), q, scale)
    with pytest.raises(ValueError, match="scale"):
        fp8_w8a16_matmul(x, q, scale[:5])
    with pytest.raises(ValueError, match="block sizes"):
        fp8_w8a16_matmul(x, q, scale, tiles=GemmTiles(8, 64, 64))
