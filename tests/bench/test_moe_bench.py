"""`batchgen bench --workload moe`: the plumbing on a tiny random-weight Qwen3-MoE (the real run uses the
16-expert model of bench/moe_model.py; its figures are measured by hand, not here): both sides do the same
token work, the MoE layers are timed on every step, and the roofline counts the active weights only."""

from __future__ import annotations

import json

import pytest
import torch

from batchgen.bench.harness import run_bench
from batchgen.bench.moe_model import make_moe_folder
from batchgen.bench.options import BenchOptions
from batchgen.bench.report import format_report
from batchgen.bench.roofline import layer_linear_shapes, num_layer_flops_per_token
from batchgen.engine.models.config import ModelConfig

TINY_MOE = {"hidden_size": 32, "num_hidden_layers": 2, "num_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 16, "intermediate_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 8, "vocab_size": 160, "max_position_embeddings": 256, "norm_topk_prob": True,
            "tie_word_embeddings": False, "decoder_sparse_step": 1, "mlp_only_layers": [], "eos_token_id": 1}


@pytest.fixture(scope="module")
def tiny_moe_folder(tmp_path_factory):
    return make_moe_folder(tmp_path_factory.mktemp("moe-bench") / "tiny", TINY_MOE, seed=0)


def test_the_folder_is_written_once_and_rewritten_when_its_config_changes(tiny_moe_folder):
    before = (tiny_moe_folder / "model.safetensors").stat().st_mtime_ns
    assert make_moe_folder(tiny_moe_folder, TINY_MOE, seed=0) == tiny_moe_folder
    assert (tiny_moe_folder / "model.safetensors").stat().st_mtime_ns == before
    assert json.loads((tiny_moe_folder / "config.json").read_text())["architectures"] == ["Qwen3MoeForCausalLM"]


def test_engine_and_hf_do_the_same_work_and_the_moe_layers_are_timed(tiny_moe_folder):
    opts = BenchOptions(workload="moe", model=str(tiny_moe_folder), num_requests=4, input_len_min=10,
                        input_len_max=20, output_len=5, peer_batch_sizes=[4], prefill_gemm_tokens=32,
                        decode_gemm_tokens=4, gemm_min_seconds=0.0, is_warmup=False,
                        engine_overrides={"kv_cache_memory": "16MiB"})
    result = run_bench(opts, say=lambda _: None)

    engine, peer, moe = result["engine_runs"]["engine"], result["peer"], result["moe"]
    assert result["is_fair"], result["unfair_reasons"]
    assert engine["completion_tokens"] == peer["completion_tokens"] == 4 * 5
    assert peer["name"].startswith("hf-transformers")
    # float32 on both sides, greedy: the same tokens (a near-tie in the router could flip one request).
    assert result["agreement"]["engine vs peer"]["num_exact"] >= 3, result["agreement"]
    # Every engine step runs each of the 2 MoE layers once.
    assert moe["num_moe_calls"] == 2 * engine["stats"]["num_steps"]
    assert 0 < moe["moe_seconds"] < engine["seconds"] and moe["moe_share_of_run"] == pytest.approx(
        moe["moe_seconds"] / engine["seconds"])
    assert (moe["num_experts"], moe["num_experts_per_tok"], moe["num_moe_layers"]) == (8, 2, 2)

    # The roofline's FLOPs from transformers' own modules: per token and layer q/k/v/o and the router in
    # full, and the top-2 experts' share of the expert weights (each expert: gate, up, down).
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_moe_folder), dtype=torch.float32)
    layer = hf.model.layers[0]
    attention = sum(m.weight.numel() for m in layer.self_attn.modules() if isinstance(m, torch.nn.Linear))
    router = layer.mlp.gate.weight.numel()
    experts = sum(p.numel() for p in layer.mlp.experts.parameters())
    per_token = 2 * 2 * (attention + router + experts * 2 // 8)  # 2 FLOPs a weight, 2 layers
    workload = result["workload"]
    assert workload["name"] == "moe" and workload["num_requests"] == 4
    num_forward = workload["num_prompt_tokens"] + 4 * (5 - 1)
    assert result["roofline"]["num_flops"] == per_token * num_forward + 2 * hf.lm_head.weight.numel() * 4 * 5
    assert moe["num_active_layer_params_per_token"] == per_token // 2
    shapes = {s["name"]: s.get("count", 1) for s in result["gemm"]["prefill"]["shapes"]}
    assert shapes == {"qkv": 1, "o": 1, "router": 1, "expert_gate_up": 2, "expert_down": 2, "lm_head": 1}
    report = format_report(result)
    assert "fused MoE layers" in report and "ratio engine / peer" in report
    json.dumps(result)


def test_a_dense_layer_among_sparse_ones_counts_its_dense_mlp():
    cfg = ModelConfig(model_type="qwen3_moe", vocab_size=10, hidden_size=4, intermediate_size=8, num_layers=2,
                      num_heads=2, num_kv_heads=1, head_dim=2, rms_norm_eps=1e-6, rope_theta=1e4,
                      max_position_embeddings=64, tie_word_embeddings=True, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=3, moe_dense_layers=(0,))
    # qkv 4*8=32, o 4*4=16 in both; layer 0 dense: gate_up 4*16=64, down 8*4=32; layer 1: router 4*4=16,
    # top-2 experts' gate_up 2*(4*6)=48 and down 2*(3*4)=24. x2 FLOPs.
    assert [s.name for s in layer_linear_shapes(cfg, 0)] == ["qkv", "o", "gate_up", "down"]
    assert num_layer_flops_per_token(cfg) == 2 * ((32 + 16 + 64 + 32) + (32 + 16 + 16 + 48 + 24))
