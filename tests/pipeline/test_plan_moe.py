"""`batchgen plan` on mixture-of-experts models: Qwen3-30B-A3B and gpt-oss-120b (their published config.json
shapes, committed under tests/pipeline/data/; gpt-oss without its quantization_config: the plan is for
the experts dequantized to bfloat16, as the engine would hold them) at bf16, 32k context, 64 requests,
80 GB GPUs. Every figure below is written out by hand from the shapes.

Qwen3-30B-A3B: 48 layers, hidden 2048, 32 query / 4 KV heads of 128, 128 experts of 768 channels, top 8,
vocabulary 151936 untied. gpt-oss-120b: 36 layers, hidden 2880, 64 query / 8 KV heads of 64, biases on
q/k/v and o_proj, 128 experts of 2880 channels with biases, top 4, a router with a bias, vocabulary 201088.
"""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from batchgen.cli.main import app
from batchgen.engine.models.config import ModelConfig

DATA = Path(__file__).parent / "data"
BF16 = 2


def plan_json(model: str, *args: str) -> dict:
    result = CliRunner().invoke(app, ["plan", str(DATA / model), "--dtype", "bfloat16", "--max-model-len", "32768",
                                      "--concurrency", "64", "--memory", "80GB", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


# Qwen3-30B-A3B, one layer: q/k/v (4096 + 2 x 512) x 2048, o_proj 2048 x 4096, two norms, q/k norms (128 each),
# router 128 x 2048, experts 128 x 3 x 768 x 2048.
QWEN_EXPERT = 3 * 768 * 2048
QWEN_LAYER = 5120 * 2048 + 2048 * 4096 + 2 * 2048 + 2 * 128 + 128 * 2048 + 128 * QWEN_EXPERT
QWEN_PARAMS = 48 * QWEN_LAYER + 2 * 151936 * 2048 + 2048  # + embedding, lm_head, final norm


def test_qwen3_30b_a3b_all_experts_resident_a_token_reads_eight():
    plan = plan_json("qwen3-30b-a3b")
    assert QWEN_PARAMS == 30_532_122_624  # the model card's 30.5B
    assert plan["num_parameters"] == QWEN_PARAMS and plan["weight_bytes"] == QWEN_PARAMS * BF16
    active = QWEN_PARAMS - 48 * 120 * QWEN_EXPERT
    assert plan["num_active_parameters"] == active == 3_353_032_704  # the card's 3.3B activated
    assert plan["decode_weight_bytes_one"] == active * BF16  # one token: exactly its 8 experts a layer
    # 64 tokens reach 128 x (1 - (120/128)^64) = 124.3 experts a layer in expectation
    touched = 128 * (1 - (120 / 128) ** 64)
    assert plan["decode_weight_bytes_batch"] == int(QWEN_PARAMS * BF16 - 48 * (128 - touched) * QWEN_EXPERT * BF16)
    assert plan["kv_bytes_per_token"] == 2 * 48 * 4 * 128 * BF16
    # tp 2 (and 3: KV heads 1 + 1 + 2): 2 KV heads on a GPU, 64 x 32768 x 49152 B = 103 GB of KV alone > 80 GB.
    # tp 4: 1 KV head, 64 x 32768 x 24576 B x 1.1 = 56.7 GB, weights 15.3 GB (below): fits.
    tp4_layer = (1024 + 256) * 2048 + 2048 * 1024 + 2 * 2048 + 2 * 128 + 128 * 2048 + 128 * 3 * 192 * 2048
    tp4_weights = (48 * tp4_layer + 2 * 37984 * 2048 + 2048) * BF16
    assert plan["smallest_tensor_parallel_size"] == 4
    assert plan_json("qwen3-30b-a3b", "--tensor-parallel-size", "4")["weight_bytes"] == tp4_weights


# gpt-oss-120b, one layer: q/k/v (4096 + 2 x 512) x 2880 with biases, o_proj 2880 x 4096 with bias, two norms,
# router 128 x 2880 + 128 bias, experts 128 x (3 x 2880 x 2880 + biases 2 x 2880 + 2880), 64 sink logits.
OSS_EXPERT = 3 * 2880 * 2880 + 2 * 2880 + 2880
OSS_LAYER = 5120 * 2880 + 5120 + 2880 * 4096 + 2880 + 2 * 2880 + 128 * 2880 + 128 + 128 * OSS_EXPERT + 64
OSS_PARAMS = 36 * OSS_LAYER + 2 * 201088 * 2880 + 2880


def test_gpt_oss_120b_is_planned_from_its_shapes():
    plan = plan_json("gpt-oss-120b")
    assert round(OSS_PARAMS / 1e9, 2) == 116.83  # the model card's 116.83B
    assert plan["num_parameters"] == OSS_PARAMS and plan["weight_bytes"] == OSS_PARAMS * BF16
    # every parameter but 124 unrouted experts a layer: 5.72B (the card's 5.13B "active" counts one of
    # the embedding and lm_head, and no expert biases)
    assert plan["num_active_parameters"] == OSS_PARAMS - 36 * 124 * OSS_EXPERT
    assert plan["kv_bytes_per_token"] == 2 * 36 * 8 * 64 * BF16
    # 8 KV heads: tp 4 and 5 each leave some GPU 2 of them. The 18 sliding-window layers (window 128) keep their
    # own small block group, so only the 18 full layers hold the context: 64 x 32768 x 9216 B x 1.1 = 21.3 GB a
    # GPU; with 233.7 GB / tp of weights that is 79.7 at tp 4 (> 80 once the window layers' blocks and the
    # activations join) and 68.0 GB at tp 5: 5 is the first to fit (7 if every layer kept the context).
    assert plan["smallest_tensor_parallel_size"] == 5
    cfg = ModelConfig.from_hf_dict(json.loads((DATA / "gpt-oss-120b" / "config.json").read_text()), is_plan_only=True)
    assert (cfg.moe_router, cfg.moe_router_bias, cfg.moe_expert_bias, cfg.num_experts_per_tok) == (
        "topk_softmax", True, True, 4)
    assert cfg == ModelConfig.from_hf_dict(json.loads((DATA / "gpt-oss-120b" / "config.json").read_text()))
    assert (cfg.attention_sinks, cfg.sliding_window, cfg.layer_types[:2]) == (
        True, 128, ("sliding_attention", "full_attention"))


def test_the_text_plan_names_experts_active_parameters_and_decode_reads():
    result = CliRunner().invoke(app, ["plan", str(DATA / "qwen3-30b-a3b"), "--dtype", "bfloat16", "--concurrency", "64"])
    assert result.exit_code == 0, result.output
    assert "128 x top 8" in result.output and "30.53 B parameters, 3.35 B active per token" in result.output
    assert "decode reads, 1 seq" in result.output and "6.71 GB" in result.output  # 3,353,032,704 x 2 bytes


# The published gpt-oss-120b config.json declares its experts MXFP4 (quantization_config quant_method "mxfp4";
# router, attention, embeddings and lm_head left out). The engine dequantizes them at load (no kernel reads
# them packed yet), so the plan prices what it holds: every expert in the model dtype, or E4M3 bytes plus a
# float32 scale per output channel under FP8 at load -- not the checkpoint's ~65 GB of packed blocks.
OSS_FP8_EXPERT = 3 * 2880 * 2880 + (2 * 2880 + 2880) * 4 + (2 * 2880 + 2880) * BF16


def test_gpt_oss_120b_with_its_mxfp4_experts_is_planned_as_the_engine_holds_them(tmp_path):
    raw = json.loads((DATA / "gpt-oss-120b" / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (tmp_path / "gpt-oss-120b").mkdir()
    (tmp_path / "gpt-oss-120b" / "config.json").write_text(json.dumps(raw))
    folder = str(tmp_path / "gpt-oss-120b")

    def plan(*args: str) -> dict:
        result = CliRunner().invoke(app, ["plan", folder, "--dtype", "bfloat16", "--max-model-len", "8192",
                                          "--concurrency", "1", "--memory", "80GB", "--json", *args])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    dequantized = plan()
    assert dequantized["weight_bytes"] == OSS_PARAMS * BF16  # 233.7 GB: the bfloat16 model's
    assert dequantized["num_parameters"] == OSS_PARAMS
    assert dequantized["smallest_tensor_parallel_size"] > 1  # the packed 65 GB would have said 1
    fp8 = plan("--quantization", "fp8")
    experts_fp8 = 36 * 128 * OSS_FP8_EXPERT
    experts_bf16 = 36 * 128 * OSS_EXPERT * BF16
    assert fp8["weight_bytes"] < OSS_PARAMS * BF16 - experts_bf16 + experts_fp8 + 1  # experts as E4M3 too
    text = CliRunner().invoke(app, ["plan", folder, "--dtype", "bfloat16"]).output
    assert "128 x top 4, MXFP4 as published, dequantized at load" in text


def test_qwen3_30b_a3b_fp8_in_blocks_is_planned_dequantized(tmp_path):
    """Qwen3-30B-A3B-FP8 declares 128 x 128 FP8 blocks; the engine loads it dequantized, so its plan is the
    bf16 model's."""
    raw = json.loads((DATA / "qwen3-30b-a3b" / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    (tmp_path / "fp8").mkdir()
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(raw))
    result = CliRunner().invoke(app, ["plan", str(tmp_path / "fp8"), "--dtype", "bfloat16", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["weight_bytes"] == QWEN_PARAMS * BF16
