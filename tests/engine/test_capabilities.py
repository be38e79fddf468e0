"""Capabilities: the attention backend selector's rules, and a report that matches what ran."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from batchgen.engine import EngineConfig, SamplingParams
from batchgen.engine.attention.cpu import CpuAttention
from batchgen.engine.attention.sdpa import SdpaAttention
from batchgen.engine.attention.selector import select_attention_backend
from batchgen.engine.attention.triton import TritonAttention
from batchgen.engine.core.llm_engine import LLMEngine
from batchgen.engine.models.cpu_linear import PackedLinear, PackedSiluMulLinear
from batchgen.kernels import cpu_elementwise, cpu_paged_attention, cpu_sampling
from tests.conftest import MODEL, TEST_ENGINE_KWARGS

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device object needs no GPU


@pytest.fixture
def without_c_attention(monkeypatch):
    """As on a machine where the C attention kernels cannot be built."""
    monkeypatch.setattr(cpu_paged_attention, "is_available", lambda: False)


def test_auto_and_torch_pick_triton_on_cuda_and_the_c_kernels_on_the_cpu_in_float32_and_bfloat16_else_sdpa():
    assert cpu_paged_attention.is_available()  # CI has a C compiler
    for requested in ("auto", "torch"):
        assert select_attention_backend(requested, CPU, torch.float32, 64) is CpuAttention
        assert select_attention_backend(requested, CUDA, torch.bfloat16, 64) is TritonAttention
        assert select_attention_backend(requested, CUDA, torch.float16, 80, is_fp8_kv=True) is TritonAttention
    assert select_attention_backend("auto", CPU, torch.float32, 64, is_fp8_kv=True) is CpuAttention
    assert select_attention_backend("auto", CPU, torch.bfloat16, 64) is CpuAttention
    assert select_attention_backend("auto", CPU, torch.float16, 64) is SdpaAttention
    # Under the interpreter (tests set TRITON_INTERPRET=1) triton is selectable on the CPU, never auto.
    assert select_attention_backend("triton", CPU, torch.float32, 64) is TritonAttention
    assert select_attention_backend("auto", CPU, torch.float32, 24) is SdpaAttention  # head_dim % 16
    assert select_attention_backend("sdpa", CPU, torch.float32, 64) is SdpaAttention
    assert select_attention_backend("cpu", CPU, torch.float32, 64) is CpuAttention


def test_a_backend_that_cannot_run_here_is_a_clear_error():
    with pytest.raises(ValueError, match="'cpu' cannot run here: its kernels run on the CPU, not on cuda"):
        select_attention_backend("cpu", CUDA, torch.float32, 64)
    with pytest.raises(ValueError, match="'torch' \\(torch means cpu on cpu\\) cannot run here: .*float32 or "
                                         "bfloat16, not float16"):
        select_attention_backend("torch", CPU, torch.float16, 64)
    with pytest.raises(ValueError, match="must be one of auto, torch, cpu, sdpa, triton; got 'flash'"):
        select_attention_backend("flash", CUDA, torch.bfloat16, 64)
    with pytest.raises(ValueError, match="'sdpa' cannot run here: it is the CPU's fallback"):
        select_attention_backend("sdpa", CUDA, torch.bfloat16, 64)
    with pytest.raises(ValueError, match="'sdpa' cannot run here: it has no FP8 KV cache"):
        select_attention_backend("sdpa", CPU, torch.float32, 64, is_fp8_kv=True)
    with pytest.raises(ValueError, match="no attention backend can run here .*sdpa: it has no FP8 KV cache"):
        select_attention_backend("auto", CPU, torch.float16, 64, is_fp8_kv=True)
    with pytest.raises(ValueError, match="interpreter computes float32/float16 only"):
        select_attention_backend("triton", CPU, torch.bfloat16, 64)


def test_triton_on_the_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="only under TRITON_INTERPRET=1"):
        select_attention_backend("triton", CPU, torch.float32, 64)


def test_without_the_c_kernels_auto_picks_sdpa_and_cpu_is_refused(without_c_attention):
    assert select_attention_backend("auto", CPU, torch.float32, 64) is SdpaAttention
    with pytest.raises(ValueError, match="C kernels could not be built"):
        select_attention_backend("cpu", CPU, torch.float32, 64)


def test_an_engine_asking_for_a_backend_that_cannot_run_fails_before_reading_weights(without_c_attention,
                                                                                     monkeypatch):
    from batchgen.engine.loader import model_loader

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were read before the backend was checked")

    monkeypatch.setattr(model_loader, "iter_gguf_weights", no_weights)
    with pytest.raises(ValueError, match="attention_backend 'cpu' cannot run here"):
        LLMEngine(EngineConfig(model=MODEL, **{**TEST_ENGINE_KWARGS, "attention_backend": "cpu"}))


@pytest.fixture
def kernel_calls(monkeypatch) -> Counter:
    """Counts calls of the C attention and sampling kernels and of torch's SDPA."""
    calls: Counter = Counter()
    targets = [(cpu_paged_attention, "paged_decode_attention"), (cpu_paged_attention, "paged_prefill_attention"),
               (cpu_sampling, "argmax_log_z"), (torch.nn.functional, "scaled_dot_product_attention")]
    for module, name in targets:
        original = getattr(module, name)

        def spy(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    return calls


@pytest.mark.parametrize("which, attention", [("llm", "cpu"), ("sdpa_llm", "sdpa")])
def test_stats_report_the_kernels_that_ran(which, attention, request, kernel_calls):
    loaded = request.getfixturevalue(which).engine
    engine = LLMEngine(loaded.config, weights_from=loaded)  # shares the model, so its capabilities too
    kernels = engine.stats["kernels"]
    assert kernels == engine.capabilities.as_dict() == loaded.capabilities.as_dict()
    assert kernels["attention_backend"] == attention and kernels["device"] == "cpu"
    engine.add_request("r", [1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    # One prefill step and two decode steps, 30 layers each, through exactly one attention path.
    is_c = attention == "cpu"
    assert kernel_calls["paged_prefill_attention"] == (30 if is_c else 0)
    assert kernel_calls["paged_decode_attention"] == (60 if is_c else 0)
    assert kernel_calls["scaled_dot_product_attention"] == (0 if is_c else 90)
    assert kernels["is_c_sampling"] and kernel_calls["argmax_log_z"] == 3
    model = engine.runner.model
    assert kernels["elementwise_ops"] == "c" and model.ops.add_rms_norm is cpu_elementwise.add_rms_norm
    assert kernels["is_onednn_packed_linear"] and isinstance(model.layers[0].self_attn.qkv_proj, PackedLinear)
    assert kernels["is_onednn_silu_mul"] and isinstance(model.layers[0].mlp.gate_up_proj, PackedSiluMulLinear)
    assert not kernels["has_triton"] and not kernels["has_fp8_matmul"] and kernels["fp8_mode"] is None
