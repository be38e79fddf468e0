"""KV-cache capacity arithmetic: the pool's sizing and the capacity plan share one bytes-per-token rule."""

from __future__ import annotations

import torch

from batchgen.engine.config import parse_memory_size
from batchgen.engine.kv import capacity
from batchgen.engine.kv.capacity import KV_FRAGMENTATION_FRACTION, num_kv_blocks, plan_capacity
from batchgen.engine.loader.model_loader import read_model_config
from batchgen.engine.loader.source import resolve_model
from batchgen.engine.models.config import ModelConfig
from tests.engine.model_shapes import (
    MISTRAL_7B_LOGITS_BYTES_PER_SEQ,
    MISTRAL_7B_SHAPE,
    MISTRAL_7B_STEP_ACTIVATION_BYTES,
)

MISTRAL_7B = ModelConfig.from_hf_dict(MISTRAL_7B_SHAPE)


def test_plan_adds_up_weights_kv_and_margin():
    plan = plan_capacity(MISTRAL_7B, torch.bfloat16, 32768, concurrency=32, max_num_batched_tokens=4096)
    assert plan.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # K and V x layers x KV heads x head_dim x bf16
    assert plan.kv_bytes == 32 * 32768 * plan.kv_bytes_per_token
    assert plan.activation_bytes == MISTRAL_7B_STEP_ACTIVATION_BYTES + 32 * MISTRAL_7B_LOGITS_BYTES_PER_SEQ
    assert plan.fragmentation_bytes == int(KV_FRAGMENTATION_FRACTION * plan.kv_bytes)
    assert plan.total_bytes == plan.weight_bytes + plan.kv_bytes + plan.fragmentation_bytes + plan.activation_bytes


def test_a_request_reserves_whole_blocks():
    plan = plan_capacity(MISTRAL_7B, torch.bfloat16, 1000, block_size=16)
    assert plan.kv_tokens_per_request == 1008  # 63 blocks of 16
    assert plan.kv_bytes_per_request == 1008 * plan.kv_bytes_per_token


def test_pool_sizing_and_plan_share_kv_bytes_per_token(monkeypatch):
    # Swap the one function: the pool's block count and the plan's KV figures must both follow it.
    monkeypatch.setattr(capacity, "kv_bytes_per_token", lambda cfg, dtype: 1000)
    assert num_kv_blocks(10**9, MISTRAL_7B, torch.bfloat16, 16) == 10**9 // (1000 * 16)
    assert plan_capacity(MISTRAL_7B, torch.bfloat16, 4096).kv_bytes_per_request == 1000 * 4096


def test_engine_pool_matches_plan(llm):
    """The loaded engine's pool (a 256 MiB budget in the test config) and weights, planned from GGUF."""
    engine = llm.engine
    cfg = read_model_config(resolve_model("smollm2-135m-instruct"))  # the config alone, no weights
    plan = plan_capacity(cfg, engine.config.torch_dtype, engine.max_model_len)
    assert engine.kv_bytes_per_token == plan.kv_bytes_per_token
    budget = parse_memory_size(engine.config.kv_cache_memory)
    assert engine.num_kv_blocks == budget // (plan.kv_bytes_per_token * engine.config.block_size)
    assert engine.weight_bytes == plan.weight_bytes
