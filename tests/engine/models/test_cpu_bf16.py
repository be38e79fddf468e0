"""bfloat16 on the CPU, both ways it runs (engine/capabilities.py): on BF16 units (bf16 activations,
packed bf16 GEMMs) and widened (bf16 weights and KV, float32 activations), each against the float32
model on the bundled checkpoint (the quality bench's teacher-forced top-1 and KL, at the bars the
bfloat16 path must meet); what `dtype: auto` picks; the widened linear against a float32 product."""

from __future__ import annotations

import pytest
import torch

from batchgen.bench.quality import run_dtype_quality_bench
from batchgen.bench.quality_prompts import QUALITY_PROMPTS
from batchgen.engine import EngineConfig
from batchgen.engine import capabilities as caps
from batchgen.engine.models.bf16_linear import MKL_MAX_ROWS, Bf16WeightLinear
from batchgen.engine.models.cpu_linear import PackedLinear
from batchgen.kernels import cpu_elementwise, cpu_isa, cpu_kv_store, cpu_paged_attention, cpu_sampling

HAS_BF16_UNITS = cpu_isa.has_bf16_units(cpu_isa.detect_isa())
NUM_PROMPTS, MAX_TOKENS = 6, 16  # 96 positions: enough to see a drift past the bars, fast enough


@pytest.fixture
def without_bf16_units(monkeypatch):
    """As on a CPU without BF16 units: the level forced to AVX2 (the kernels already loaded stay as
    built; the engine's choice of path is what changes)."""
    for module in (cpu_elementwise, cpu_kv_store, cpu_paged_attention, cpu_sampling):
        assert module.is_available()  # loaded natively before the level changes
    if cpu_isa.detect_isa() not in cpu_isa.ISA_LEVELS:
        pytest.skip("no x86 level to force on this CPU")
    monkeypatch.setenv(cpu_isa.ISA_VARIABLE, "avx2")
    caps.auto_cpu_dtype.cache_clear()
    yield
    caps.auto_cpu_dtype.cache_clear()


def assert_bf16_quality(result: dict) -> dict:
    entry = result["dtype_results"][0]
    assert result["num_completion_tokens"] >= NUM_PROMPTS * 8
    assert entry["top1_agreement"] >= 0.97 and entry["mean_kl"] <= 0.01, entry
    assert 0.45 <= entry["weight_bytes"] / entry["float32_weight_bytes"] <= 0.55  # bf16: half the bytes
    return entry


@pytest.mark.skipif(not HAS_BF16_UNITS, reason="this CPU has no BF16 units (AVX-512 BF16 / AMX)")
def test_bf16_on_bf16_units_keeps_float32_quality_with_bf16_kernels_throughout(llm, monkeypatch):
    calls = []
    decode = cpu_paged_attention.paged_decode_attention
    monkeypatch.setattr(cpu_paged_attention, "paged_decode_attention",
                        lambda q, *a, **k: calls.append((q.dtype, a[0].dtype)) or decode(q, *a, **k))
    result = run_dtype_quality_bench(prompts=QUALITY_PROMPTS[:NUM_PROMPTS], max_tokens=MAX_TOKENS,
                                     engine=llm.engine, compare_hf=False)
    entry = assert_bf16_quality(result)
    kernels = entry["kernels"]
    assert (kernels["bf16_path"], kernels["compute_dtype"], kernels["has_bf16_units"]) == ("bf16_units", "bfloat16",
                                                                                          True)
    assert kernels["attention_backend"] == "cpu" and kernels["elementwise_ops"] == "c"
    assert kernels["is_onednn_packed_linear"] and kernels["cpu_isa"] in ("avx512_bf16", "amx")
    # The bf16 model's decodes: bf16 queries over a bf16 cache (the float32 reference's are float32).
    assert set(calls) == {(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)}


def test_widened_bf16_without_bf16_units_keeps_float32_quality(llm, without_bf16_units):
    result = run_dtype_quality_bench(prompts=QUALITY_PROMPTS[:NUM_PROMPTS], max_tokens=MAX_TOKENS,
                                     engine=llm.engine, compare_hf=False)
    kernels = assert_bf16_quality(result)["kernels"]
    assert (kernels["bf16_path"], kernels["compute_dtype"], kernels["has_bf16_units"]) == ("widened", "float32",
                                                                                          False)
    assert kernels["cpu_isa"] == "avx2" and kernels["attention_backend"] == "cpu"
    assert not kernels["is_onednn_packed_linear"]


def test_widened_engine_stores_bf16_weights_and_kv_and_computes_in_float32(llm, without_bf16_units):
    from batchgen.engine import LLM, SamplingParams
    from tests.conftest import MODEL, TEST_ENGINE_KWARGS

    bf16 = LLM(MODEL, **{**TEST_ENGINE_KWARGS, "dtype": "bfloat16"})
    model = bf16.engine.runner.model
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Bf16WeightLinear) and qkv.weight.dtype == torch.bfloat16
    assert model.lm_head.weight is model.embed_tokens.weight  # still tied, in bf16
    assert model.layers[0].input_layernorm.weight.dtype == torch.float32
    kv_cache = bf16.engine.stats["kv_cache"]
    assert kv_cache["dtype"] == "bfloat16"
    assert kv_cache["bytes_per_token"] == llm.engine.stats["kv_cache"]["bytes_per_token"] // 2
    assert kv_cache["bytes"] == kv_cache["num_tokens"] * kv_cache["bytes_per_token"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in bf16.generate(QUALITY_PROMPTS[:3], params)]
    reference = [o.outputs[0].token_ids for o in llm.generate(QUALITY_PROMPTS[:3], params)]
    assert sum(a[:3] == b[:3] for a, b in zip(ours, reference)) >= 2  # bf16 rounding may move a token


def test_dtype_auto_is_bf16_only_where_bf16_runs_on_bf16_units(monkeypatch):
    caps.auto_cpu_dtype.cache_clear()
    try:
        expected = torch.bfloat16 if HAS_BF16_UNITS else torch.float32
        assert EngineConfig(model="m", device="cpu").torch_dtype == expected
        if cpu_isa.detect_isa() in cpu_isa.ISA_LEVELS:
            monkeypatch.setenv(cpu_isa.ISA_VARIABLE, "avx2")
            caps.auto_cpu_dtype.cache_clear()
            assert EngineConfig(model="m", device="cpu").torch_dtype == torch.float32
        assert EngineConfig(model="m", device="cpu", dtype="float32").torch_dtype == torch.float32
    finally:
        caps.auto_cpu_dtype.cache_clear()


@pytest.mark.parametrize("num_rows", [3, MKL_MAX_ROWS + 5])  # MKL's bf16 GEMM; widened weight + oneDNN
def test_the_widened_linear_multiplies_the_bf16_weight_in_float32(num_rows):
    gen = torch.Generator().manual_seed(0)
    plain = torch.nn.Linear(96, 40, dtype=torch.bfloat16)
    with torch.no_grad():
        plain.weight.copy_(torch.randn(40, 96, generator=gen))
        plain.bias.copy_(torch.randn(40, generator=gen))
    layer = Bf16WeightLinear(plain)
    assert layer.weight is plain.weight and layer.bias.dtype == torch.float32
    x = torch.randn(num_rows, 96, generator=gen)
    got = layer(x)
    assert got.dtype == torch.float32
    # The few-row path rounds its inputs to bf16 (MKL's bf16 GEMM), the many-row path keeps them float32.
    inputs = x.to(torch.bfloat16).double() if num_rows <= MKL_MAX_ROWS else x.double()
    expected = inputs @ plain.weight.double().t() + plain.bias.double()
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-4)
    with pytest.raises(TypeError, match="bfloat16 weight"):
        Bf16WeightLinear(torch.nn.Linear(4, 4))


def test_packed_bf16_linears_where_onednn_runs_bf16():
    probe = torch.nn.Linear(64, 32, dtype=torch.bfloat16)
    if not caps.can_pack(torch.device("cpu"), torch.bfloat16):
        assert not HAS_BF16_UNITS or cpu_isa.is_forced()  # BF16 units and no bf16 packing: a broken path
        return
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    got = PackedLinear(probe)(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), probe(x).float(), rtol=2e-2, atol=2e-2)
