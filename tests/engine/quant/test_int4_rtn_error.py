"""int4 round to nearest on SmolLM2-135M (`int_calibration: none`, and the inner quantizer of the
activation-aware search): the quantizer equals round to nearest as defined, and the kernels add nothing.

Why int4 lands where it does (test_int_quality.py): bench/int_rtn_error.py measures each layer's weight
error against a round-to-nearest written from its definition, and the IntLinear model against the same
weights dequantized into plain float layers.
"""

from __future__ import annotations

import torch

from batchgen.bench.int_rtn_error import kernel_against_fake_quantization, layer_errors, rtn_reference
from batchgen.bench.quality_prompts import QUALITY_PROMPTS
from batchgen.engine.quant.int_formats.rtn import quantize_int4_groups
from batchgen.engine.quant.weight_report import linear_layers


def test_the_quantizer_is_round_to_nearest_and_smaller_groups_err_less(llm):
    model = llm.engine.runner.model
    rows = layer_errors(model, (128, 32))
    assert len(rows) == 120
    for r in rows:
        assert abs(r["engine_g128"] - r["rtn_g128"]) < 1e-6 and abs(r["engine_g32"] - r["rtn_g32"]) < 1e-6, r
        assert r["rtn_g32"] < r["rtn_g128"], r
        # The float weights are GGUF Q4_1 blocks (32 columns, float minima): that form gives them back.
        assert r["float_min_g32"] < 1e-6, r
        assert 0.05 < r["rtn_g128"] < 0.15, r  # 4 bits over 128 columns: ~10% of the weight's norm
    # Weight for weight, not only in norm (a K of 576 ends in a group of 64).
    w = linear_layers(model)["layers.3.self_attn.o_proj"].weight.detach().float()
    assert torch.allclose(quantize_int4_groups(w).dequantize(), rtn_reference(w, 128), rtol=0, atol=1e-7)


def test_the_kernels_equal_fake_quantization(llm):
    engine = llm.engine
    r = kernel_against_fake_quantization(engine.runner.model, engine.tokenizer, engine.eos_token_ids,
                                         QUALITY_PROMPTS[:3], 5)
    same = r["kernels_vs_fake_quantized"]
    assert same["num_positions"] == 15 and same["top1_agreement"] == 1.0 and same["mean_kl"] < 1e-8, same
    assert r["fake_quantized_vs_float"]["mean_kl"] > 1e-2, r  # int4 does change the model
