"""E4M3 quantize/dequantize: round-trip error within E4M3's precision for each scale layout."""

from __future__ import annotations

import pytest
import torch

from batchgen.engine.quant.fp8_tensor import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize_fp8,
    quantize_fp8,
    quantize_fp8_per_token,
)

# E4M3: 3 mantissa bits, so rounding a normal value (|v| >= 2**-6) moves it by at most half an ulp,
# 2**-4 of its magnitude; below that, subnormals are spaced 2**-9 apart (error <= 2**-10).
REL_HALF_ULP = 2.0**-4
SUBNORMAL_HALF_STEP = 2.0**-10


def e4m3_error_bound(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per-element bound on |dequant(quant(w)) - w| for scale (N,) or (1,): in units of the scale,
    max(2**-4 * |w / s|, 2**-10); a hair of slack for float32's own rounding of w / s."""
    s = scale.reshape(-1, 1)
    return torch.maximum(REL_HALF_ULP * w.abs(), SUBNORMAL_HALF_STEP * s) * (1 + 1e-5)


def rows_of_varied_magnitude(num_rows: int = 64, num_cols: int = 96) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    magnitudes = 10.0 ** torch.linspace(-5, 1, num_rows)  # rows from 1e-5 to 10: per-tensor scales suffer
    return torch.randn(num_rows, num_cols, generator=gen) * magnitudes[:, None]


@pytest.mark.parametrize("layout", ["channel", "tensor"])
def test_round_trip_error_is_within_e4m3_precision(layout):
    w = rows_of_varied_magnitude()
    q, scale = quantize_fp8(w, layout)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape and scale.dtype == torch.float32
    assert scale.shape == ((w.shape[0],) if layout == "channel" else (1,))
    err = (dequantize_fp8(q, scale) - w).abs()
    assert (err <= e4m3_error_bound(w, scale)).all()
    # The scale maps each group's largest magnitude exactly onto E4M3's largest value.
    amax_q = q.float().abs().amax(dim=1) if layout == "channel" else q.float().abs().amax().reshape(1)
    assert torch.equal(amax_q, torch.full_like(amax_q, FP8_MAX))


def test_per_channel_keeps_small_rows_precise_where_per_tensor_cannot():
    w = rows_of_varied_magnitude()
    rel = {}
    for layout in ("channel", "tensor"):
        q, scale = quantize_fp8(w, layout)
        rel[layout] = ((dequantize_fp8(q, scale) - w).norm(dim=1) / w.norm(dim=1))  # (N,) per row
    # Per channel every row uses the full range: about E4M3's RMS rounding error (~2**-4/sqrt(3) at worst).
    assert rel["channel"].max() < REL_HALF_ULP / 3**0.5
    # One scale for rows 1e6 apart (E4M3 spans ~2**24 with subnormals) pushes the smallest rows into subnormals or to zero.
    assert rel["tensor"][:8].min() > 0.2


def test_zero_rows_and_dtypes_round_trip():
    w = torch.zeros(4, 32)
    w[1] = torch.linspace(-2, 2, 32)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        q, scale = quantize_fp8(w.to(dtype), "channel")
        assert torch.isfinite(scale).all() and not torch.isnan(q.float()).any()
        assert torch.equal(dequantize_fp8(q, scale)[0], torch.zeros(32))  # a zero row stays exactly zero
        assert dequantize_fp8(q, scale, dtype).dtype == dtype


def test_per_token_activation_quantization_has_one_scale_per_row():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 48, generator=gen) * torch.tensor([1e-2, 1.0, 30.0, 0.0, 500.0])[:, None]
    q, scale = quantize_fp8_per_token(x)
    assert scale.shape == (5, 1) and q.dtype == FP8_DTYPE
    err = (q.float() * scale - x).abs()
    assert (err <= e4m3_error_bound(x, scale.reshape(-1))).all()
    assert torch.equal(q[3].float(), torch.zeros(48))


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="layout"):
        quantize_fp8(torch.ones(2, 2), "block")
    with pytest.raises(ValueError, match="2-D"):
        quantize_fp8(torch.ones(2, 2, 2))
