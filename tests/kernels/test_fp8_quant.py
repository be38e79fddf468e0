"""The fused per-token FP8 activation quantization (Triton, interpreter) against its torch reference."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel module is imported: jit reads it then

import pytest
import torch

from batchgen.kernels.fp8_quant import MAX_BLOCK_K, quantize_fp8_per_token_triton
from batchgen.kernels.reference import quantize_fp8_per_token_ref
from tests.kernels.helpers import assert_within_one_fp8_step


def rows(m: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of very different magnitudes (each row gets its own scale), one all zero."""
    gen = torch.Generator().manual_seed(m * 1000 + k)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-3, 2, m).reshape(m, 1)
    x[m // 2] = 0.0
    return x.to(dtype)


@pytest.mark.triton
@pytest.mark.parametrize("m, k, dtype", [(1, 64, torch.float32), (5, 130, torch.float16),
                                         (3, MAX_BLOCK_K + 52, torch.float32)])  # K past one block: the loop
def test_matches_the_reference_within_one_fp8_step(m, k, dtype):
    x = rows(m, k, dtype)
    q, scale = quantize_fp8_per_token_triton(x)
    q_ref, scale_ref = quantize_fp8_per_token_ref(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (m, k) and scale.shape == (m, 1)
    torch.testing.assert_close(scale, scale_ref, rtol=0, atol=0)  # the same float32 arithmetic
    assert scale[m // 2].item() == pytest.approx(1e-12)  # the zero row
    assert_within_one_fp8_step(q, q_ref)  # the interpreter's own FP8 cast errs on a few values
    # Each row uses its range: the largest magnitude lands on (or one step below) 448.
    largest = q.float().abs().amax(dim=1)
    nonzero = torch.arange(m) != m // 2
    assert torch.all(largest[nonzero] >= 416.0)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="contiguous rows"):
        quantize_fp8_per_token_triton(torch.randn(64, 4).t())
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        quantize_fp8_per_token_triton(torch.randn(4, 64).double())
