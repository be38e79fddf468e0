"""EngineConfig checks every setting on construction, naming the field; LLM keywords are its fields."""

from __future__ import annotations

import pytest
import torch

from batchgen.engine import LLM, EngineConfig, SamplingParams
from batchgen.engine.config import ATTENTION_BACKENDS, DTYPES, SettingError
from batchgen.engine.cpu_dtype import auto_cpu_dtype


@pytest.mark.parametrize("kwargs, field", [
    ({"dtype": "float64"}, "dtype"),
    ({"quantization": "int3"}, "quantization"),
    ({"fp8_mode": "w4a4"}, "fp8_mode"),
    ({"attention_backend": "flash"}, "attention_backend"),
    ({"kv_cache_dtype": "int8"}, "kv_cache_dtype"),
    ({"kv_cache_dtype": "fp8_e4m3fn"}, "kv_cache_dtype"),  # vLLM's names only
    ({"device": "tpu"}, "device"),
    ({"device": "cuda:x"}, "device"),
    ({"block_size": 0}, "block_size"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
    ({"max_model_len": 1}, "max_model_len"),
    ({"kv_cache_memory": float("inf")}, "kv_cache_memory"),
    ({"kv_cache_memory": float("nan")}, "kv_cache_memory"),
    ({"kv_cache_memory": -1}, "kv_cache_memory"),
    ({"kv_cache_memory": "lots"}, "kv_cache_memory"),
    ({"num_kv_blocks": 0}, "num_kv_blocks"),
    ({"max_cuda_graph_size": 0}, "max_cuda_graph_size"),
    ({"async_scheduling": "yes"}, "async_scheduling"),
    ({"num_threads": 0}, "num_threads"),
])
def test_invalid_engine_settings_name_the_field(kwargs, field):
    with pytest.raises(SettingError, match=rf"^EngineConfig\.{field} .*; got ") as info:
        EngineConfig(model="m", **kwargs)
    assert info.value.name == field and repr(info.value.value) == repr(kwargs[field])


def test_every_offered_choice_is_accepted():
    for backend in ATTENTION_BACKENDS:
        assert EngineConfig(model="m", attention_backend=backend).attention_backend == backend
    for dtype in ("auto", *DTYPES):
        EngineConfig(model="m", dtype=dtype)
    for memory in ("auto", "8GiB", 0.5, 1.0, 2**30):
        EngineConfig(model="m", kv_cache_memory=memory)
    assert EngineConfig(model="m", device="cuda:1").device == "cuda:1"
    assert set(ATTENTION_BACKENDS) == {"auto", "cpu", "sdpa", "triton", "torch"}
    kv_dtypes = {name: EngineConfig(model="m", device="cpu", kv_cache_dtype=name).kv_torch_dtype
                 for name in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")}
    # auto is the model dtype, which on the CPU depends on its BF16 units (cpu_dtype.auto_cpu_dtype)
    assert kv_dtypes == {"auto": auto_cpu_dtype(), "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                         "fp8_e5m2": torch.float8_e5m2}


def test_llm_keywords_are_engine_config_fields_and_a_typo_lists_them():
    with pytest.raises(TypeError, match=r"unknown engine setting\(s\) max_num_seq; EngineConfig's are: revision, dtype, .*"
                                        r"max_num_seqs"):
        LLM("unused", max_num_seq=4)  # refused before anything loads
    with pytest.raises(SettingError, match="EngineConfig.block_size"):
        LLM("unused", block_size=0)


def test_add_request_refuses_stop_token_ids_outside_the_vocabulary(llm):
    vocab = llm.engine.model_cfg.vocab_size
    with pytest.raises(ValueError, match=rf"stop_token_ids \[{vocab}\] reach past the vocabulary \({vocab} tokens\)"):
        llm.engine.add_request("bad-stop", "Hi", SamplingParams(stop_token_ids=[vocab], min_tokens=1))
    assert not llm.engine.has_unfinished()
    llm.engine.add_request("edge-stop", "Hi", SamplingParams(temperature=0, max_tokens=2, stop_token_ids=[vocab - 1]))
    while llm.engine.has_unfinished():
        llm.engine.step()
