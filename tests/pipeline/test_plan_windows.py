"""`batchgen plan` on models with sliding-window layers, priced per layer type (kv/window_groups.py): Gemma 2 9B
and Gemma 3 27B (published config.json shapes under tests/pipeline/data/; Gemma 3's are its text model's) at
bf16, 32k context, 16 requests, 80 GB GPUs, blocks of 16 and 4,096 batched tokens. Every figure written out
by hand from the shapes.

A layer's K and V per token: 2 x KV heads x head_dim x 2 bytes = 8,192 B in both models. Gemma 3 27B: 62
layers, every sixth global (5, 11, ..., 59: 10), 52 local with a 1,024 window; Gemma 2 9B: 42 layers
alternating from a local one (21 + 21), window 4,096. A local layer holds at most ceil((W - 1) / 16) + 1
blocks of a sequence: 65 blocks = 1,040 tokens (Gemma 3), 257 = 4,112 (Gemma 2); the pool also keeps one
step's chunk of local blocks: (4,096 / 16 + 1) x 16 = 4,112 tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from batchgen.cli.main import app

DATA = Path(__file__).parent / "data"
LAYER_TOKEN = 2 * 16 * 128 * 2  # Gemma 3 27B: 16 KV heads of 128
assert LAYER_TOKEN == 2 * 8 * 256 * 2  # Gemma 2 9B: 8 KV heads of 256
CONTEXT, STEP_TOKENS = 32768, 4112


def plan(model: str, *args: str) -> dict:
    result = CliRunner().invoke(app, ["plan", str(DATA / model), "--dtype", "bfloat16", "--max-model-len", str(CONTEXT),
                                      "--concurrency", "16", "--memory", "80GB", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_gemma_3_27b_at_32k_keeps_only_the_window_in_its_52_local_layers():
    p = plan("gemma-3-27b-text")
    assert (p["num_local_layers"], p["local_window"], p["local_kv_tokens_per_request"]) == (52, 1024, 1040)
    assert p["kv_bytes_per_token"] == 62 * LAYER_TOKEN == 507_904  # every layer, as a full-attention pool
    assert p["local_kv_bytes_per_token"] == 52 * LAYER_TOKEN
    per_request = 10 * LAYER_TOKEN * CONTEXT + 52 * LAYER_TOKEN * 1040
    assert p["kv_bytes_per_request"] == per_request == 3_127_377_920  # 3.13 GB, not 16.64 GB
    assert p["local_step_reserve_bytes"] == 52 * LAYER_TOKEN * STEP_TOKENS == 1_751_646_208
    assert p["kv_bytes"] == 16 * per_request + 1_751_646_208 == 51_789_692_928
    # 80 GB - 54.02 GB of weights - 0.75 GB of activations - 1.1 x the step's chunk: 6 requests of 1.1 x 3.13 GB
    assert p["max_concurrency"] == 6
    # Over two GPUs each holds 8 of the 16 KV heads: half of every figure, the same split.
    tp2 = plan("gemma-3-27b-text", "--tensor-parallel-size", "2")
    assert tp2["num_local_layers"] == 52 and tp2["kv_bytes_per_request"] == per_request // 2


def test_gemma_2_9b_at_32k_halves_its_kv_less_than_gemma_3():
    p = plan("gemma-2-9b-it")
    assert (p["num_local_layers"], p["local_window"], p["local_kv_tokens_per_request"]) == (21, 4096, 4112)
    assert p["kv_bytes_per_token"] == 42 * LAYER_TOKEN == 344_064
    assert p["kv_bytes_per_request"] == 21 * LAYER_TOKEN * CONTEXT + 21 * LAYER_TOKEN * 4112 == 6_344_540_160
    assert p["kv_bytes"] == 16 * 6_344_540_160 + 21 * LAYER_TOKEN * STEP_TOKENS


def test_the_text_plan_says_what_each_layer_type_holds():
    result = CliRunner().invoke(app, ["plan", str(DATA / "gemma-3-27b-text"), "--dtype", "bfloat16",
                                      "--max-model-len", str(CONTEXT), "--concurrency", "16"])
    assert result.exit_code == 0, result.output
    assert "32,768 tokens in 10 global layers, 1,040 in 52 sliding-window layers (window 1,024)" in result.output
    assert "3.13 GB" in result.output and "51.79 GB" in result.output
