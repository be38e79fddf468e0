"""`batchgen plan --tensor-parallel-size`: Llama-3.1-70B-Instruct (its published config.json, committed
under tests/pipeline/data/) at bf16, 8k context, 32 requests, on 80 GB GPUs.

The expected figures are written out below from the shapes, by hand: one GPU's weights, KV cache and
step activations at tensor_parallel_size 2 and 4 (8 KV heads split 4 + 4 and 2 + 2 + 2 + 2; 64 query
heads 32 and 16 a GPU; the MLP's 28672 channels and the 128256-row vocabulary, embedding and lm_head
untied, in equal slices), and the smallest size that fits: 4 (3 splits the 8 KV heads 2 + 3 + 3,
whose largest GPU needs 80.2 GB before the margin).
"""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from batchgen.cli.main import app

LLAMA_70B = Path(__file__).parent / "data" / "llama-3.1-70b-instruct"
H, L, HEADS, KV_HEADS, D, INTER, VOCAB = 8192, 80, 64, 8, 128, 28672, 128256
CONTEXT, REQUESTS, BF16 = 8192, 32, 2
BATCHED_TOKENS = 4096  # the engine's max_num_batched_tokens default


def plan_json(*args: str) -> dict:
    result = CliRunner().invoke(app, ["plan", str(LLAMA_70B), "--dtype", "bfloat16", "--max-model-len",
                                      str(CONTEXT), "--concurrency", str(REQUESTS), "--memory", "80GB", *args,
                                      "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def gpu_weight_bytes(tp: int) -> int:
    """One GPU's parameters x 2 bytes: its q/k/v rows, o_proj columns, MLP channels, vocabulary rows,
    and every norm."""
    q_rows, kv_rows, channels, vocab_rows = HEADS // tp * D, KV_HEADS // tp * D, INTER // tp, -(-VOCAB // tp)
    per_layer = ((q_rows + 2 * kv_rows) * H  # qkv_proj
                 + H * q_rows  # o_proj
                 + 2 * channels * H + H * channels  # gate_up_proj, down_proj
                 + 2 * H)  # the two norms
    return (L * per_layer + 2 * vocab_rows * H + H) * BF16  # + embedding, lm_head, the final norm


def gpu_kv_bytes_per_token(tp: int) -> int:
    return 2 * L * (KV_HEADS // tp) * D * BF16


def gpu_activation_bytes(tp: int) -> int:
    """capacity.activation_workspace_bytes on one GPU's shapes: per batched token the residual and its
    normed copy, q/k/v, the attention output and 3 x the MLP's channels; per sampled request the
    whole vocabulary's float32 logits and softmax (rank 0 gathers them)."""
    q, kv, channels = HEADS // tp * D, KV_HEADS // tp * D, INTER // tp
    per_token = 2 * H + q + 2 * kv + q + 3 * channels
    return BATCHED_TOKENS * per_token * BF16 + REQUESTS * 2 * VOCAB * 4


def gpu_total_bytes(tp: int) -> int:
    kv = REQUESTS * CONTEXT * gpu_kv_bytes_per_token(tp)
    return gpu_weight_bytes(tp) + kv + int(0.10 * kv) + gpu_activation_bytes(tp)


def test_the_arithmetic_by_hand():
    assert gpu_weight_bytes(1) == 141_107_412_992  # 70.55B parameters
    assert gpu_weight_bytes(2) == 70_555_025_408
    assert gpu_weight_bytes(4) == 35_278_831_616
    assert gpu_kv_bytes_per_token(2) == 163_840 and gpu_kv_bytes_per_token(4) == 81_920
    assert gpu_total_bytes(2) > 80e9 > gpu_total_bytes(4)


def test_per_gpu_bytes_and_the_smallest_size_that_fits_80gb():
    for tp in (1, 2, 4):
        plan = plan_json("--tensor-parallel-size", str(tp))
        assert plan["tensor_parallel_size"] == tp
        assert plan["weight_bytes"] == gpu_weight_bytes(tp)
        assert plan["kv_bytes_per_token"] == gpu_kv_bytes_per_token(tp)
        assert plan["kv_bytes"] == REQUESTS * CONTEXT * gpu_kv_bytes_per_token(tp)
        assert plan["activation_bytes"] == gpu_activation_bytes(tp)
        assert plan["total_bytes"] == gpu_total_bytes(tp)
        assert plan["fits"] is (tp == 4)
        assert plan["smallest_tensor_parallel_size"] == 4
    # 3 GPUs: 8 KV heads in whole groups 2 + 3 + 3; the largest GPU (24 query heads, 9558 channels,
    # 42752 vocabulary rows) holds 48.05 GB of weights and 32.21 GB of KV for 32 requests: 80.26 GB.
    three = plan_json("--tensor-parallel-size", "3")
    assert three["kv_bytes_per_token"] == 2 * L * 3 * D * BF16
    assert three["total_bytes_before_margin"] > 80e9 and not three["fits"]


def test_text_names_the_gpus_and_the_smallest_size():
    result = CliRunner().invoke(app, ["plan", str(LLAMA_70B), "--dtype", "bfloat16", "--max-model-len", "8192",
                                      "--concurrency", "32", "--memory", "80GB", "--tensor-parallel-size", "2"])
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "tensor-parallel over 2 GPUs (sizes per GPU)" in text
    assert "70.56 GB" in text and "4 KV heads (of 8, on one GPU)" in text
    assert "smallest tensor_parallel_size for 32 concurrent requests in 80.00 GB GPUs: 4" in text


def test_a_size_the_model_cannot_split_over_is_refused():
    result = CliRunner().invoke(app, ["plan", str(LLAMA_70B), "--tensor-parallel-size", "65"])
    assert result.exit_code == 2
    assert "tensor_parallel_size 65" in result.output and "64 query heads" in result.output
