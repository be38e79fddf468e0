"""Dequantization of the expert formats MoE checkpoints publish, against independent references:

- MXFP4 (quant/mxfp4.py): every E2M1 code against the value its bits define (OCP MX v1.0: sign, 2-bit
  exponent with bias 1, 1 mantissa bit, exponent 0 subnormal), E8M0 scales at their bounds (2^-127, 2^127,
  255 NaN), a block packed by hand, and transformers' own gpt-oss dequantization on random blocks;
- FP8 with block scales (quant/fp8_block.py): a hand-written 3 x 5 weight in 2 x 2 blocks (partial edge
  blocks) and transformers' fine-grained FP8 dequantization on random (E, N, K) weights in 128 x 128 blocks.
"""

from __future__ import annotations

import math

import pytest
import torch

from batchgen.engine.quant.fp8_block import dequantize_fp8_block
from batchgen.engine.quant.mxfp4 import dequantize_mxfp4


def e2m1_value(code: int) -> float:
    """The OCP MX v1.0 E2M1 value of a 4-bit code, from its bits."""
    sign = -1.0 if code & 0b1000 else 1.0
    exponent, mantissa = (code >> 1) & 0b11, code & 0b1
    if exponent == 0:  # subnormal: 2^(1 - bias) x 0.m
        return sign * mantissa * 0.5
    return sign * 2.0 ** (exponent - 1) * (1 + mantissa * 0.5)


def pack(codes: list[int]) -> list[int]:
    """32 codes -> 16 bytes, the first of each pair in the lower nibble."""
    return [codes[i] | codes[i + 1] << 4 for i in range(0, len(codes), 2)]


def test_every_e2m1_code_with_a_unit_scale_is_its_defined_value():
    codes = list(range(16)) * 2
    out = dequantize_mxfp4(torch.tensor([pack(codes)], dtype=torch.uint8), torch.tensor([127], dtype=torch.uint8))
    assert out.shape == (32,)
    assert out.tolist() == [e2m1_value(c) for c in codes]
    assert [e2m1_value(c) for c in range(8)] == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert math.copysign(1.0, out[8].item()) == -1.0  # code 8 is -0


def test_e8m0_scales_at_their_bounds_and_nan():
    codes = [2] * 32  # 1.0 everywhere
    blocks = torch.tensor([pack(codes)] * 6, dtype=torch.uint8)
    scales = torch.tensor([0, 126, 127, 128, 254, 255], dtype=torch.uint8)
    out = dequantize_mxfp4(blocks, scales).view(6, 32)
    assert out[:5, 0].tolist() == [2.0 ** -127, 0.5, 1.0, 2.0, 2.0 ** 127]
    assert torch.isnan(out[5]).all()


def test_a_hand_packed_block():
    # values 1.0, -0.5, 6.0, 0.0, 3.0, -4.0, 1.5, -6.0 then zeros, scale 2^-2 (code 125)
    first = [0x92, 0x07, 0xE5, 0xF3] + [0x00] * 12
    out = dequantize_mxfp4(torch.tensor([first], dtype=torch.uint8), torch.tensor([125], dtype=torch.uint8))
    assert out[:8].tolist() == [0.25, -0.125, 1.5, 0.0, 0.75, -1.0, 0.375, -1.5]
    assert out[8:].abs().sum().item() == 0.0


def test_random_blocks_equal_transformers_gpt_oss_dequantization():
    from transformers.integrations.mxfp4 import _convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 5, 4, 16), generator=gen, dtype=torch.uint8)  # 3 experts, 5 rows, K 128
    scales = torch.randint(110, 140, (3, 5, 4), generator=gen, dtype=torch.uint8)
    ours = dequantize_mxfp4(blocks, scales)
    theirs = _convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)  # theirs: (E, K, N)
    assert ours.shape == (3, 5, 128)
    assert torch.equal(ours, theirs)
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.bfloat16).float(), ours)  # exact in bfloat16 too


def test_mxfp4_layout_mistakes_are_refused():
    with pytest.raises(ValueError, match=r"\(\.\.\., G, 16\)"):
        dequantize_mxfp4(torch.zeros(2, 32, dtype=torch.uint8), torch.zeros(2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(torch.zeros(2, 16, dtype=torch.int8), torch.zeros(2, dtype=torch.uint8))


def test_fp8_blocks_by_hand_with_partial_edge_blocks():
    weight = torch.tensor([[1.0, -2.0, 0.5, 4.0, -1.5],
                           [448.0, 0.25, -0.125, 3.0, 1.0],
                           [2.0, -448.0, 6.0, -0.5, 0.75]]).to(torch.float8_e4m3fn)
    assert weight.float().tolist()[1][0] == 448.0  # every value above is exact in e4m3
    scale_inv = torch.tensor([[0.5, 2.0, 4.0], [0.125, 1.0, -1.0]])  # 2 x 2 blocks: rows {0,1},{2}; cols {0,1},{2,3},{4}
    expected = [[0.5, -1.0, 1.0, 8.0, -6.0],
                [224.0, 0.125, -0.25, 6.0, 4.0],
                [0.25, -56.0, 6.0, -0.5, -0.75]]
    assert dequantize_fp8_block(weight, scale_inv, (2, 2)).tolist() == expected
    with pytest.raises(ValueError, match=r"needs scales of shape \(2, 3\)"):
        dequantize_fp8_block(weight, scale_inv[:, :2], (2, 2))


def test_fp8_blocks_equal_transformers_fine_grained_fp8_dequantization():
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    gen = torch.Generator().manual_seed(1)
    weight = (torch.randn(2, 300, 260, generator=gen) * 100).to(torch.float8_e4m3fn)  # partial blocks both ways
    scale_inv = torch.rand(2, 3, 3, generator=gen) + 0.01
    ours = dequantize_fp8_block(weight, scale_inv, (128, 128))
    theirs = _dequantize_fp8_weight(weight, scale_inv, [128, 128], torch.float32)
    assert torch.equal(ours, theirs)
