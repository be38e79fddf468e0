"""Fp8Linear against the float32 linear it replaces, and its two matmul paths against each other."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchgen.engine.quant.fp8 import resolve_fp8_mode
from batchgen.engine.quant.fp8_linear import Fp8Linear
from batchgen.engine.quant.fp8_tensor import FP8_DTYPE

# Rounding to E4M3 perturbs each weight by a relative error of at most 2**-4 (half an ulp); spread
# evenly in that band its RMS is 2**-4/sqrt(3) ~ 0.036. The output sums K independent such
# errors, so its relative RMS error is about the weights (measured below). With
# activations rounded too, two independent errors add in quadrature: at most sqrt(2) times that.
W8A16_REL_BOUND = 2.0**-4 / 3**0.5  # 0.036; measured 0.024 (channel), 0.026 (tensor)
W8A8_REL_BOUND = 2**0.5 * W8A16_REL_BOUND  # 0.051; measured 0.036 (channel), 0.037 (tensor)
# Quantization must really happen: an error far below E4M3's would mean a float weight slipped through.
MIN_REL_ERROR = 0.005


def rel_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y - ref).norm() / ref.norm()).item()


def random_linear(in_features=256, out_features=192, bias=False, seed=0) -> nn.Linear:
    torch.manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():  # rows of different magnitude, as in trained layers
        linear.weight.mul_(torch.rand(out_features, 1) * 4 + 0.1)
    return linear


@pytest.mark.parametrize("layout", ["channel", "tensor"])
def test_quantized_linear_matches_float32_within_e4m3_error(layout):
    linear = random_linear()
    x = torch.randn(37, 256, generator=torch.Generator().manual_seed(1))
    ref = linear(x)
    fp8 = Fp8Linear.from_linear(linear, layout)
    assert fp8.weight.dtype == FP8_DTYPE and fp8.is_per_tensor == (layout == "tensor")
    for mode, bound in (("w8a16", W8A16_REL_BOUND), ("w8a8", W8A8_REL_BOUND)):
        fp8.set_mode(mode)
        y = fp8(x)
        assert y.dtype == torch.float32 and y.shape == ref.shape
        assert MIN_REL_ERROR < rel_error(y, ref) < bound, mode


def test_w8a8_and_w8a16_agree():
    linear = random_linear(bias=True)
    fp8 = Fp8Linear.from_linear(linear)
    x = torch.randn(3, 11, 256, generator=torch.Generator().manual_seed(2))  # leading dims are kept
    ref = linear(x)
    fp8.set_mode("w8a16")
    y16 = fp8(x)
    fp8.set_mode("w8a8")
    y8 = fp8(x)
    assert y8.shape == y16.shape == (3, 11, 192)
    # Same FP8 weights: they differ only by the activations' rounding.
    assert rel_error(y8, y16) < W8A16_REL_BOUND
    assert rel_error(y8, ref) < W8A8_REL_BOUND


def test_w8a8_uses_a_static_input_scale_when_given():
    linear = random_linear()
    fp8 = Fp8Linear.from_linear(linear, mode="w8a8")
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(3))
    fp8.input_scale = x.abs().max() / 448  # calibrated on this very input: the whole range is used
    assert rel_error(fp8(x), linear(x)) < W8A8_REL_BOUND
    fp8.input_scale = x.abs().max() / 448 / 16  # too small: activations saturate at +-448, a clear error
    assert rel_error(fp8(x), linear(x)) > 0.2


def test_bfloat16_activations():
    linear = random_linear().to(torch.bfloat16)
    fp8 = Fp8Linear.from_linear(linear)
    x = torch.randn(8, 256, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(4))
    ref = linear.float()(x.float())
    for mode in ("w8a16", "w8a8"):
        fp8.set_mode(mode)
        y = fp8(x)
        assert y.dtype == torch.bfloat16
        assert rel_error(y.float(), ref) < W8A8_REL_BOUND


def test_auto_mode_picks_w8a8_only_with_fp8_tensor_cores(monkeypatch):
    assert resolve_fp8_mode("auto", torch.device("cpu"))[0] == "w8a16"
    assert resolve_fp8_mode("w8a8", torch.device("cpu"))[0] == "w8a8"  # slow on the CPU, but allowed
    for capability, expected in (((9, 0), "w8a8"), ((8, 9), "w8a8"), ((8, 0), "w8a16")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert resolve_fp8_mode("auto", torch.device("cuda")) == (expected, f"auto on CUDA compute capability "
                                                                             f"{capability[0]}.{capability[1]}")
    with pytest.raises(ValueError, match="compute capability >= 8.9"):
        resolve_fp8_mode("w8a8", torch.device("cuda"))  # capability still (8, 0)


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="fp8 mode"):
        Fp8Linear.from_linear(random_linear()).set_mode("w4a16")


@pytest.mark.triton
def test_w8a16_through_the_triton_kernel_equals_the_torch_path():
    """The kernel runs under TRITON_INTERPRET=1 here (tests/conftest.py); tests/kernels/ checks it alone."""
    torch.manual_seed(0)
    layer = Fp8Linear.from_linear(torch.nn.Linear(80, 48, bias=True), mode="w8a16")
    x = torch.randn(2, 3, 80)  # leading dims and bias go through the module, not the kernel
    torch_path = layer(x)
    layer.use_triton = True  # quantize_model_fp8 sets this only on CUDA, after a probe
    torch.testing.assert_close(layer(x), torch_path, rtol=1e-5, atol=1e-5)


def test_w8a8_quantizes_its_input_with_the_fused_kernel_when_told(monkeypatch):
    """The wiring: with quantize_on_triton the layer calls kernels/fp8_quant.py once per forward and
    feeds its codes and scales to the same _scaled_mm (tests/kernels/test_fp8_quant.py checks the
    kernel itself; here it is stood in by its reference, so the output must be the torch path's)."""
    import batchgen.kernels.fp8_quant as fp8_quant
    from batchgen.kernels.reference import quantize_fp8_per_token_ref

    calls = []

    def kernel_stand_in(x):
        calls.append(tuple(x.shape))
        return quantize_fp8_per_token_ref(x)

    monkeypatch.setattr(fp8_quant, "quantize_fp8_per_token_triton", kernel_stand_in)
    torch.manual_seed(0)
    layer = Fp8Linear.from_linear(torch.nn.Linear(80, 48, bias=True), mode="w8a8")
    x = torch.randn(2, 3, 80)
    torch_path = layer(x)
    assert calls == []
    layer.quantize_on_triton = True  # quantize_model_fp8 sets this only on CUDA, after a probe
    torch.testing.assert_close(layer(x), torch_path, rtol=0, atol=0)
    assert calls == [(6, 80)]  # once, on the flattened (M, K) input
