"""The block Hadamard rotation of activation-aware int4: the matrix, the layer's arithmetic, what it buys."""

from __future__ import annotations

import pytest
import torch

from batchgen.engine.quant.calibrate.activation_aware import quantize_activation_aware
from batchgen.engine.quant.hadamard import block_hadamard, hadamard_matrix
from batchgen.engine.quant.int_formats.rtn import quantize_int4_groups
from batchgen.engine.quant.int_linear import IntLinear
from tests.engine.input_statistics import output_error, statistics_of


def sylvester_by_entries(n: int) -> torch.Tensor:
    """H[i, j] = (-1)^popcount(i & j) / sqrt(n): Sylvester's matrix from its closed form, not by doubling."""
    i = torch.arange(n)
    bits = (i[:, None] & i[None, :]).tolist()
    signs = torch.tensor([[(-1.0) ** b.bit_count() for b in row] for row in bits], dtype=torch.float64)
    return signs / n ** 0.5


def test_the_matrix_is_sylvesters_orthogonal_and_symmetric():
    h = hadamard_matrix(64, torch.float64)
    assert torch.equal(h, sylvester_by_entries(64))
    assert torch.allclose(h @ h, torch.eye(64, dtype=torch.float64), atol=1e-12)  # R = R^T = R^-1
    with pytest.raises(ValueError, match="power-of-2"):
        hadamard_matrix(48)


def test_block_rotation_is_one_hadamard_block_per_64_columns():
    x = torch.randn(3, 5, 192, dtype=torch.float64)
    r = torch.block_diag(*[sylvester_by_entries(64)] * 3)
    assert torch.allclose(block_hadamard(x, 64), x @ r, atol=1e-12)
    assert torch.allclose(block_hadamard(block_hadamard(x, 64), 64), x, atol=1e-12)


def scattered_outlier_layer(n: int = 64, k: int = 256, num_tokens: int = 2048, seed: int = 0):
    """W (n, k) with 1% of its entries 12x larger, scattered (no loud input channel for a scale to
    favour: the inputs are uniform), and inputs X (num_tokens, k)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    w[torch.rand(n, k, generator=gen) < 0.01] *= 12
    return w, torch.randn(num_tokens, k, generator=gen)


def test_rotation_spreads_scattered_weight_outliers():
    w, x = scattered_outlier_layer()
    held_out = torch.randn(1024, 256, generator=torch.Generator().manual_seed(5))
    errors = {}
    for size in (64, 0):
        int_weight, p, rotation = quantize_activation_aware(w, statistics_of(x), 4, torch.float32, torch.float32,
                                                            hadamard_size=size)
        assert rotation == size
        layer = IntLinear(int_weight, pre_quant_scale=p, hadamard_size=rotation)
        errors[size] = ((layer(held_out) - held_out @ w.t()).norm() / (held_out @ w.t()).norm()).item()
    rtn_error = output_error(w, quantize_int4_groups(w).dequantize(), held_out)
    assert errors[64] < 0.8 * errors[0] and errors[0] <= 1.05 * rtn_error, (errors, rtn_error)


def test_the_rotated_layer_computes_its_float_reference():
    w, x = scattered_outlier_layer(n=40, k=192)
    int_weight, p, rotation = quantize_activation_aware(w, statistics_of(x), 4, torch.float32, torch.float32)
    assert rotation == 64
    bias = torch.randn(40)
    layer = IntLinear(int_weight, bias, pre_quant_scale=p, hadamard_size=rotation)
    rows = x[:17]
    expected = block_hadamard(rows * p, 64) @ int_weight.dequantize().t() + bias
    assert torch.allclose(layer(rows), expected, rtol=1e-5, atol=1e-4)
    # The quality bench's float reference: x @ dequantized_weight^T is the same layer, and close to W.
    assert torch.allclose(rows @ layer.dequantized_weight().t() + bias, expected, rtol=1e-4, atol=1e-3)
    assert (layer.dequantized_weight() - w).norm() < 0.15 * w.norm()
    # Nothing is stored for the rotation: the same bytes as without it.
    assert layer.num_weight_bytes() == IntLinear(int_weight, bias, pre_quant_scale=p).num_weight_bytes()
    with pytest.raises(ValueError, match="divisible"):
        IntLinear(quantize_int4_groups(torch.randn(8, 200)), hadamard_size=64)
