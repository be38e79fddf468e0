"""engine.kv_cache_dtype: FP8 caches with per-layer scales (checkpoint, 1.0, or calibrated on the first
step), the pool sized by their bytes, the engine's report, and their quality on the bundled model."""

from __future__ import annotations

import pytest
import torch

from batchgen.bench.quality import run_kv_cache_quality_bench
from batchgen.engine import LLMEngine
from batchgen.engine.attention.kv_cache import MIN_KV_SCALE, allocate_kv_caches
from batchgen.kernels.kv_formats import fp8_code_values


def test_allocation_takes_checkpoint_scales_else_one_and_calibrates_on_request():
    cpu = torch.device("cpu")
    plain = allocate_kv_caches(2, 32, 2, 16, torch.float32, cpu, checkpoint_scales={0: {"k": 0.5, "v": 0.25}})
    assert all(c.k_scale is None and not c.is_fp8 for c in plain)  # a float cache has no scales
    fp8 = allocate_kv_caches(2, 32, 2, 16, torch.float8_e4m3fn, cpu, checkpoint_scales={0: {"k": 0.5, "v": 0.25}})
    assert [(c.k_scale.item(), c.v_scale.item()) for c in fp8] == [(0.5, 0.25), (1.0, 1.0)]
    assert fp8[0].k.dtype == torch.float8_e4m3fn and fp8[0].k.shape == (32, 2, 16)
    assert not fp8[0].needs_scales
    k_lut, v_lut = fp8[0].lookup_tables()
    torch.testing.assert_close(k_lut, fp8_code_values(torch.float8_e4m3fn) * 0.5, rtol=0, atol=0, equal_nan=True)

    (calibrated,) = allocate_kv_caches(1, 32, 2, 16, torch.float8_e5m2, cpu, calculate_scales=True)
    assert calibrated.needs_scales
    k, v = torch.randn(5, 2, 16), torch.zeros(5, 2, 16)
    k[3, 1, 7] = -114688.0  # absmax: 2 x e5m2's largest value
    calibrated.calibrate(k, v)
    assert calibrated.k_scale.item() == 2.0 and calibrated.v_scale.item() == pytest.approx(MIN_KV_SCALE)
    calibrated.calibrate(k * 10, v + 1)  # later steps leave the scales alone
    assert calibrated.k_scale.item() == 2.0 and not calibrated.needs_scales
    torch.testing.assert_close(calibrated.lookup_tables()[0], fp8_code_values(torch.float8_e5m2) * 2.0,
                               rtol=0, atol=0, equal_nan=True)


def test_fp8_kv_on_the_bundled_model_reports_a_quarter_of_the_bytes_and_keeps_quality(llm):
    engine = llm.engine
    fp8 = LLMEngine(engine.config.replace(kv_cache_dtype="fp8"), weights_from=engine)
    bytes_per_token = engine.stats["kv_cache"]["bytes_per_token"] // 4
    assert fp8.stats["kv_cache"] == {"dtype": "float8_e4m3fn", "bytes_per_token": bytes_per_token,
                                     "num_tokens": fp8.num_kv_blocks * fp8.config.block_size,
                                     "bytes": fp8.num_kv_blocks * fp8.config.block_size * bytes_per_token}
    assert fp8.num_kv_blocks == 4 * engine.num_kv_blocks  # the same kv_cache_memory holds 4x the tokens
    # Scales calibrated on the first step (with 1.0, no checkpoint scales, top-1 is ~94.6% on the full bench).
    result = run_kv_cache_quality_bench(kv_cache_dtype="fp8", num_prompts=3, max_tokens=12, engine=engine,
                                        calculate_kv_scales=True)
    (entry,) = result["kv_results"]
    assert entry["kv_bytes_ratio"] == 0.25 and entry["engine_kv_cache"]["dtype"] == "float8_e4m3fn"
    assert entry["top1_agreement"] >= 0.95 and entry["mean_kl"] <= 0.02, entry
    assert entry["mean_kl"] > 0  # the FP8 cache was really read (float32's would give exactly 0)
