"""int_calibration activation_aware: the searches on synthetic layers, the statistics, the layer's arithmetic.

The bundled model's figures with it (and with round to nearest) are test_int_quality.py's.
"""

from __future__ import annotations

import pytest
import torch

from batchgen.engine.quant.calibrate.activation_aware import (
    CALIBRATION_TEXT,
    calibration_windows,
    gather_input_statistics,
    quantize_activation_aware,
)
from batchgen.engine.quant.int_formats.rtn import (
    int4_fake_quantized_groups,
    int4_from_ranges,
    int4_group_ranges,
    int8_fake_quantized,
    quantize_int4_groups,
    quantize_int8_per_channel,
)
from batchgen.engine.quant.int_linear import IntLinear
from tests.engine.input_statistics import hessian_blocks, output_error, statistics_of


def loud_channel_layer(n: int = 48, k: int = 200, num_tokens: int = 512, seed: int = 0):
    """W (n, k) and inputs X (num_tokens, k) where 6 channels are 30x louder than the rest (as the
    residual stream's outlier channels); K = 200 ends in a short int4 group."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    loud = torch.randperm(k, generator=gen)[:6]
    x = torch.randn(num_tokens, k, generator=gen)
    x[:, loud] *= 30
    return w, x


@pytest.mark.parametrize("bits", [8, 4])
def test_activation_aware_beats_round_to_nearest_on_held_out_inputs(bits):
    w, x = loud_channel_layer()
    _, held_out = loud_channel_layer(seed=0, num_tokens=1024)  # same loud channels, new tokens
    held_out = held_out[512:]
    int_weight, p, _ = quantize_activation_aware(w, statistics_of(x), bits, torch.float32, torch.float32)
    assert p.shape == (200,) and p.dtype == torch.float32
    aware = int_weight.dequantize() * p  # the weight the layer multiplies by
    rtn = (quantize_int8_per_channel(w) if bits == 8 else quantize_int4_groups(w)).dequantize()
    aware_error, rtn_error = output_error(w, aware, held_out), output_error(w, rtn, held_out)
    assert aware_error < 0.7 * rtn_error, (aware_error, rtn_error)
    # The loud channels got the larger effective scale: p is smallest there.
    loud = x.abs().mean(0) > 10
    assert p[loud].max() < p[~loud].min()


def test_uniform_inputs_keep_round_to_nearest():
    """No loud channel, no reason to move: alpha 0 (p = 1) is among the candidates, and the search
    (with clipping) does no worse than it on the calibration inputs."""
    gen = torch.Generator().manual_seed(1)
    w, x = torch.randn(32, 256, generator=gen), torch.randn(4096, 256, generator=gen)
    stats = statistics_of(x)
    int_weight, p, _ = quantize_activation_aware(w, stats, 4, torch.float32, torch.float32, hadamard_size=0)
    aware = int_weight.dequantize() * p
    rtn = quantize_int4_groups(w).dequantize()
    assert output_error(w, aware, x) <= output_error(w, rtn, x) + 1e-6


def test_the_layer_multiplies_inputs_by_the_pre_quant_scale():
    w, x = loud_channel_layer(n=40, k=136)
    int_weight, p, rotation = quantize_activation_aware(w, statistics_of(x), 4, torch.float32, torch.float32)
    assert rotation == 0  # K = 136 is no multiple of 64
    bias = torch.randn(40)
    layer = IntLinear(int_weight, bias, pre_quant_scale=p)
    expected = (x[:17] * p) @ int_weight.dequantize().t() + bias
    assert torch.allclose(layer(x[:17]), expected, rtol=1e-5, atol=1e-4)
    # Its float reference (the quality bench's) is deq * p column-wise, and close to W.
    assert torch.allclose(layer.dequantized_weight(), int_weight.dequantize() * p, rtol=1e-6, atol=1e-6)
    # The bytes it reports hold the scale: K float32 values more than the same codes without one.
    assert layer.num_weight_bytes() - IntLinear(int_weight, bias).num_weight_bytes() == 136 * 4


def test_sixteen_bit_models_get_a_pre_quant_scale_in_their_dtype():
    w, x = loud_channel_layer(n=32, k=128)
    int_weight, p, _ = quantize_activation_aware(w, statistics_of(x), 8, torch.float16, torch.bfloat16)
    assert p.dtype == torch.bfloat16 and int_weight.scales.dtype == torch.float16
    # The codes hold W / p with p as stored (rounded to bfloat16 before dividing): nothing is lost there.
    assert torch.allclose(int_weight.dequantize() * p.float(), w, rtol=0, atol=0.02 * w.abs().max().item())


def test_statistics_are_the_layer_inputs_second_moment(llm):
    """Layer 0's qkv_proj input is input_layernorm(embedding): its statistics from the tokens directly."""
    model = llm.engine.runner.model
    windows = [list(range(100, 140)), list(range(500, 530))]
    layer = model.layers[0].self_attn.qkv_proj
    stats = gather_input_statistics(model, {"qkv": layer}, windows)["qkv"]
    x = model.embed_tokens.weight[torch.tensor([t for w in windows for t in w])].float()  # (70, hidden)
    norm = model.layers[0].input_layernorm
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.float()
    assert stats.hessian_blocks.shape == (5, 128, 128)  # K = 576: four full groups and one of 64
    assert torch.allclose(stats.hessian_blocks, hessian_blocks(x), rtol=1e-4, atol=1e-5)
    assert torch.allclose(stats.mean_square, (x * x).mean(0), rtol=1e-4, atol=1e-6)
    assert torch.allclose(stats.mean_abs, x.abs().mean(0), rtol=1e-4, atol=1e-6)


def test_calibration_windows_come_from_the_bundled_text(llm):
    tokenizer = llm.engine.tokenizer
    windows = calibration_windows(tokenizer, max_model_len=256, num_tokens=1000)
    assert [len(w) for w in windows] == [256, 256, 256, 232]
    first_doc = CALIBRATION_TEXT.read_text(encoding="utf-8").split("\n\n\f")[0]
    assert windows[0] == tokenizer.encode(first_doc)[:256]
    # A model with fewer embeddings than the tokenizer has ids never sees an id it cannot embed.
    small = calibration_windows(tokenizer, max_model_len=256, vocab_size=2000, num_tokens=1000)
    assert all(t < 2000 for w in small for t in w) and sum(map(len, small)) == 1000


def test_fake_quantization_equals_the_stored_codes_dequantized():
    """The searches score weights through the fake-quantized forms; the layer holds the IntWeight."""
    w, _ = loud_channel_layer(n=24, k=200)
    assert torch.equal(int8_fake_quantized(w), quantize_int8_per_channel(w).dequantize())
    lo, hi = int4_group_ranges(w, 128)
    fake = int4_fake_quantized_groups(w, lo * 0.8, hi * 0.9, 128).reshape(24, -1)
    assert torch.equal(fake[:, :200], int4_from_ranges(w, lo * 0.8, hi * 0.9, 128).dequantize())
    assert torch.equal(fake[:, 200:], torch.zeros(24, 56))  # the padding dequantizes to 0
