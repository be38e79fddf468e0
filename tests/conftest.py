"""Shared fixtures: the bundled SmolLM2-135M-Instruct, loaded once per session (ours and HF's)."""

from __future__ import annotations

import os

import pytest

# The costly kinds' guard (tests/cost_markers.py): a test that starts a server, Ray, Chromium, a Python
# child or a Triton kernel fails unless it carries that marker.
pytest_plugins = ("tests.cost_markers", "pytester")  # pytester: the guard's own test

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# OpenMP threads sleep between parallel regions instead of spinning. On a CPU shared with other
# processes, spinning threads of the main thread's team wait on descheduled peers at every barrier:
# measured on the 2-core VM at load ~10, LLM.generate of 2 prompts x 8 tokens took 14 s with the
# default policy and 0.9-1.4 s with PASSIVE (read by libgomp when torch is first imported: set here).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Ray on the loopback address only (tests talk to 127.0.0.1 alone): Ray resolves a node's address
# through ray_constants.ENABLE_RAY_CLUSTER, false -> the loopback IP; read when ray is imported here and
# from the environment in the processes it starts. Without it a Cluster's GCS takes the machine's address.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Triton kernels run under the interpreter on the CPU. Set before any test module imports triton:
# transformers' model modules may import it first, and triton reads the variable at import.
os.environ.setdefault("TRITON_INTERPRET", "1")

MODEL = "smollm2-135m-instruct"
# Small KV pool for tests: the design's CPU default (4 GiB) is more than a test needs. 256 MiB holds
# 5824 tokens of SmolLM2's KV, so max_model_len must stay below that (the model's own is 8192).
TEST_ENGINE_KWARGS = dict(dtype="float32", device="cpu", kv_cache_memory="256MiB", max_model_len=2048)


@pytest.fixture(scope="session")
def smollm_path():
    from batchgen.engine.loader.source import bundled_model_path

    return bundled_model_path(MODEL)


@pytest.fixture(scope="session")
def llm():
    """One engine on the real model for tests that do not change engine settings."""
    from batchgen.engine import LLM

    return LLM(MODEL, **TEST_ENGINE_KWARGS)


@pytest.fixture(scope="session")
def hf_model(smollm_path):
    """HF transformers' own Llama on the same GGUF: the reference no one here wrote."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(smollm_path.parent), gguf_file=smollm_path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_tokenizer(smollm_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm_path.parent), gguf_file=smollm_path.name)


@pytest.fixture(scope="session")
def smollm_hf_folder(hf_model, hf_tokenizer, tmp_path_factory):
    """The bundled model as an HF folder (written once per session): config.json, 100 MB safetensors shards
    and tokenizer files, the tensors HF transformers loaded from the GGUF."""
    import gc

    folder = tmp_path_factory.mktemp("smollm2-hf")
    # transformers refuses to save a model it loaded from GGUF (its quantizer is attached), so the
    # same tensors go into a plain model of the same config first.
    config = hf_model.config.to_dict()
    config.pop("quantization_config", None)
    plain = type(hf_model)(type(hf_model.config).from_dict(config))
    plain.load_state_dict(hf_model.state_dict())
    plain.save_pretrained(folder, max_shard_size="100MB", safe_serialization=True)
    hf_tokenizer.save_pretrained(folder)
    del plain
    gc.collect()
    return folder


@pytest.fixture(scope="session")
def lora_adapters(smollm_hf_folder, tmp_path_factory):
    """LoRA adapters A-D made with peft on the bundled model in HF form (tests/lora_adapters.py):
    (peft model holding all four, {name: PEFT folder})."""
    from tests.lora_adapters import build_adapters

    return build_adapters(smollm_hf_folder, tmp_path_factory.mktemp("lora-adapters"))


@pytest.fixture(scope="session")
def lora_requests(lora_adapters):
    """{name: LoRARequest} for adapters A-D, ids 1-4 in name order."""
    from batchgen.engine import LoRARequest

    _, folders = lora_adapters
    return {name: LoRARequest(name, i + 1, str(folder)) for i, (name, folder) in enumerate(sorted(folders.items()))}


@pytest.fixture(scope="session")
def lora_llm(smollm_hf_folder):
    """One engine with enable_lora (4 slots, rank <= 16) over the bundled model in HF form."""
    from batchgen.engine import LLM

    return LLM(str(smollm_hf_folder), enable_lora=True, max_loras=4, max_lora_rank=16, **TEST_ENGINE_KWARGS)
