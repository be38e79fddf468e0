"""`batchgen plan --quantization`: Qwen2.5-7B-Instruct's weight bytes in bf16, FP8, INT8 and INT4 group 128,
against arithmetic done here from its config.json (written from a dict: no download).

The arithmetic: per decoder layer, fused q/k/v (3584 + 2 x 512 rows), o (3584), gate/up (2 x 18944)
and down (3584 rows of 18944) linear layers, plus q/k/v biases and two norms in bf16; embeddings
and the untied lm_head in bf16 (152064 x 3584 each). FP8: 1 byte per weight + a float32 scale per
row; INT8: 1 byte + a 16-bit scale per row; INT4: half a byte + a 16-bit scale and zero per 128.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from batchgen.cli.main import app

QWEN25_7B_INSTRUCT = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
    "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
    "vocab_size": 152064, "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645,
}
H, I, LAYERS, KV, V = 3584, 18944, 28, 4 * 128, 152064
LINEARS = [(H + 2 * KV, H), (H, H), (2 * I, H), (H, I)]  # (rows N, columns K) per layer


def linear_bytes(scheme: str, n: int, k: int) -> int:
    return {"bf16": 2 * n * k, "fp8": n * k + 4 * n, "int8": n * k + 2 * n,
            "int4": n * k // 2 + n * (-(-k // 128)) * (2 + 2)}[scheme]


def expected_bytes(scheme: str) -> int:
    per_layer = sum(linear_bytes(scheme, n, k) for n, k in LINEARS) + 2 * (H + 2 * KV) + 2 * 2 * H
    return LAYERS * per_layer + 2 * V * H * 2 + 2 * H  # embeddings + lm_head, final norm


@pytest.mark.parametrize("quantization, scheme, about_gb", [
    ("none", "bf16", 15.2), ("fp8", "fp8", 8.7), ("int8", "int8", 8.7), ("int4", "int4", 5.6)])
def test_qwen25_7b_weight_bytes(tmp_path, quantization, scheme, about_gb):
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_7B_INSTRUCT))
    result = CliRunner().invoke(app, ["plan", str(tmp_path), "--dtype", "bfloat16", "--quantization",
                                      quantization, "--json"])
    assert result.exit_code == 0, result.output
    planned = json.loads(result.stdout)["weight_bytes"]
    assert abs(planned - expected_bytes(scheme)) <= 0.01 * expected_bytes(scheme), (planned, expected_bytes(scheme))
    assert abs(planned / 1e9 - about_gb) <= 0.06 * about_gb, planned  # the round figures


def test_a_declared_gptq_folder_is_planned_from_its_config_and_conflicts_exit_2(tmp_path):
    config = {**QWEN25_7B_INSTRUCT, "quantization_config": {
        "quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = CliRunner().invoke(app, ["plan", str(tmp_path), "--dtype", "bfloat16", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    # Symmetric GPTQ-Int4: half a byte per weight and a 16-bit scale per 128 (no zeros held).
    linears = sum(n * k // 2 + n * (-(-k // 128)) * 2 for n, k in LINEARS)
    assert plan["quantization"] == "gptq"
    assert plan["weight_bytes"] == expected_bytes("bf16") - LAYERS * sum(2 * n * k for n, k in LINEARS) + LAYERS * linears
    conflict = CliRunner().invoke(app, ["plan", str(tmp_path), "--quantization", "int8"])
    assert conflict.exit_code == 2 and "int8 conflicts with" in conflict.stderr and "declares gptq" in conflict.stderr
