"""The bench harness: a fair comparison (same token work, agreeing greedy tokens), its roofline and
GEMM-rate arithmetic, and deterministic workloads. Throughput itself is measured by hand, not here."""

from __future__ import annotations

import json
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import typer
from typer.testing import CliRunner

from batchgen.bench import gemm_rate
from batchgen.bench.engine_side import parse_engine_overrides
from batchgen.bench.gemm_rate import measure_gemm_rate
from batchgen.bench.harness import run_bench
from batchgen.bench.options import BenchOptions
from batchgen.bench.report import format_report
from batchgen.bench.roofline import (
    num_layer_flops_per_token,
    num_lm_head_flops_per_token,
    workload_roofline,
)
from batchgen.bench.workloads import (
    SHARED_SYSTEM_PROMPT,
    BenchRequest,
    chat_workload,
    common_prefix_len,
    random_workload,
    read_chat_prompts,
    shared_prefix_workload,
    special_token_ids,
)
from batchgen.cli.bench import bench_command
from batchgen.engine.models.config import ModelConfig

TINY = ModelConfig(model_type="llama", vocab_size=10, hidden_size=4, intermediate_size=8, num_layers=2,
                   num_heads=2, num_kv_heads=1, head_dim=2, rms_norm_eps=1e-6, rope_theta=1e4,
                   max_position_embeddings=64, tie_word_embeddings=True)


# ---- fairness: the harness end to end on a tiny workload ----------------------------------------
def test_engine_and_peer_do_the_same_work_and_agree(llm, hf_model):
    opts = BenchOptions(workload="random", num_requests=4, input_len_min=20, input_len_max=40, output_len=8,
                        seed=0, peer_batch_sizes=[2, 4], prefill_gemm_tokens=64, decode_gemm_tokens=8,
                        gemm_min_seconds=0.01, is_warmup=False)
    result = run_bench(opts, engine=llm.engine, peer_model=hf_model, say=lambda _: None)

    engine, peer, workload = result["engine_runs"]["engine"], result["peer"], result["workload"]
    assert result["is_fair"], result["unfair_reasons"]
    assert engine["prompt_tokens"] == peer["prompt_tokens"] == workload["num_prompt_tokens"]
    assert engine["completion_tokens"] == peer["completion_tokens"] == 4 * 8
    assert [r["batch_size"] for r in peer["runs"]] == [2, 4]
    # Same weights, both float32, greedy: tokens agree unless two logits tie within float32
    # rounding (the engine runs flat varlen batches and fused q/k/v, HF padded batches), which a
    # different BLAS could trigger for one request; so allow one divergent request, no more.
    agreement = result["agreement"]["engine vs peer"]
    assert agreement["num_requests"] == 4
    assert agreement["num_exact"] >= 3, agreement
    assert agreement["mean_prefix_len"] >= 6, agreement
    assert result["ratio_vs_peer"] == pytest.approx(
        engine["completion_tokens_per_s"] / peer["completion_tokens_per_s"])

    # The GEMM rates were measured at the model's own linear shapes, which HF's modules confirm.
    hf_attn, hf_mlp = hf_model.model.layers[0].self_attn, hf_model.model.layers[0].mlp
    hidden = hf_model.config.hidden_size
    qkv_out = sum(m.out_features for m in (hf_attn.q_proj, hf_attn.k_proj, hf_attn.v_proj))
    expected_shapes = [("qkv", hidden, qkv_out),
                       ("o", hf_attn.o_proj.in_features, hidden),
                       ("gate_up", hidden, hf_mlp.gate_proj.out_features + hf_mlp.up_proj.out_features),
                       ("down", hf_mlp.down_proj.in_features, hidden),
                       ("lm_head", hidden, hf_model.config.vocab_size)]
    for phase, num_tokens in (("prefill", 64), ("decode", 8)):
        gemm = result["gemm"][phase]
        assert gemm["num_tokens"] == num_tokens
        assert [(s["name"], s["in_features"], s["out_features"]) for s in gemm["shapes"]] == expected_shapes
        layer = gemm["shapes"][:4]  # the layer rate leaves lm_head out
        rate = (sum(2 * s["num_tokens"] * s["in_features"] * s["out_features"] for s in layer)
                / sum(s["seconds"] for s in layer))
        assert gemm["gflops_per_s"] == pytest.approx(rate / 1e9)

    # The roofline by hand from HF's own parameter count: 2 FLOPs per weight per token, through every
    # decoder linear for each token run forward (a prompt and all but the last completion token), and
    # through lm_head for each sampled token; at the prefill-shape layer rate.
    num_layer_params = sum(m.weight.numel() for m in hf_model.model.layers.modules()
                           if isinstance(m, torch.nn.Linear))
    num_forward, num_sampled = workload["num_prompt_tokens"] + 4 * (8 - 1), 4 * 8
    roofline = result["roofline"]
    assert roofline["num_flops"] == (2 * num_layer_params * num_forward
                                     + 2 * hf_model.lm_head.weight.numel() * num_sampled)
    assert roofline["gemm_gflops_per_s"] == pytest.approx(result["gemm"]["prefill"]["gflops_per_s"])
    assert roofline["seconds"] == pytest.approx(roofline["num_flops"] / (roofline["gemm_gflops_per_s"] * 1e9))
    # Both produce the same 32 tokens, so the fraction of the roofline is a ratio of seconds.
    assert result["fraction_of_roofline"] == pytest.approx(roofline["seconds"] / engine["seconds"])
    json.dumps(result)  # --json must be able to print it
    assert "ratio engine / peer" in format_report(result)


# ---- roofline arithmetic ------------------------------------------------------------------------
def test_roofline_flops_match_a_hand_computation():
    # TINY: hidden 4, q 2x2=4, kv 1x2=2, intermediate 8, 2 layers, vocab 10.
    # Per layer, in*out: qkv 4*(4+2+2)=32, o 4*4=16, gate_up 4*16=64, down 8*4=32 -> 144; x2 FLOPs, x2 layers.
    assert num_layer_flops_per_token(TINY) == 2 * 144 * 2 == 576
    assert num_lm_head_flops_per_token(TINY) == 2 * 4 * 10 == 80
    # Prompts of 3 and 5 tokens, 4 completion tokens each: (3+3) + (5+3) = 14 tokens run forward,
    # 8 sampled: 14*576 + 8*80 = 8704 FLOPs.
    roof = workload_roofline(TINY, [3, 5], [4, 4], gemm_flops_per_s=1000.0)
    assert (roof.num_forward_tokens, roof.num_sampled_tokens) == (14, 8)
    assert roof.num_flops == 14 * 576 + 8 * 80 == 8704
    assert roof.seconds == pytest.approx(8.704)
    assert roof.completion_tokens_per_s == pytest.approx(8 / 8.704)


# ---- GEMM rate ----------------------------------------------------------------------------------
def test_gemm_rate_is_the_layer_shapes_flops_over_their_seconds(monkeypatch):
    seconds = {(4, 8): 1.0, (4, 4): 2.0, (4, 16): 4.0, (8, 4): 8.0, (4, 10): 16.0}  # (in, out) -> s
    monkeypatch.setattr(gemm_rate, "_time_linear",
                        lambda shape, *args: seconds[(shape.in_features, shape.out_features)])
    rate = measure_gemm_rate(TINY, num_tokens=3)
    assert [(s.name, s.in_features, s.out_features) for s in rate.shapes] == [
        ("qkv", 4, 8), ("o", 4, 4), ("gate_up", 4, 16), ("down", 8, 4), ("lm_head", 4, 10)]
    # 3 rows: qkv 2*3*4*8 = 192 FLOPs in 1 s, o 96 in 2 s, gate_up 384 in 4 s, down 192 in 8 s.
    assert rate.layer_flops_per_s == (192 + 96 + 384 + 192) / (1 + 2 + 4 + 8)
    assert rate.shapes[-1].gflops_per_s == 2 * 3 * 4 * 10 / 16.0 / 1e9  # lm_head: reported, not in the layer rate


def test_gemm_timing_is_the_median_of_timed_calls_after_two_warmups():
    calls = []

    def nap():  # a known duration, and one that other processes on the machine cannot shorten
        calls.append(1)
        time.sleep(0.02)

    seconds = gemm_rate._median_seconds(nap, min_seconds=0.0, min_repeats=5)
    assert len(calls) == 2 + 5
    assert 0.02 <= seconds < 0.2  # seconds, not milliseconds; a busy machine may oversleep a little


# ---- workloads ----------------------------------------------------------------------------------
def test_random_workload_is_deterministic_and_in_range():
    make = lambda seed: random_workload(16, 10, 30, 5, seed, vocab_size=100, excluded_token_ids={0, 1, 2, 99})
    first, again, other = make(3), make(3), make(4)
    assert [r.prompt_token_ids for r in first.requests] == [r.prompt_token_ids for r in again.requests]
    assert [r.prompt_token_ids for r in first.requests] != [r.prompt_token_ids for r in other.requests]
    assert all(10 <= n <= 30 for n in first.prompt_lens) and len(set(first.prompt_lens)) > 1
    assert first.output_lens == [5] * 16
    assert not {t for r in first.requests for t in r.prompt_token_ids} & {0, 1, 2, 99}


def test_random_workload_excludes_the_models_special_tokens(hf_tokenizer):
    special = special_token_ids(hf_tokenizer)
    assert {0, 1, 2} <= special  # SmolLM2: <|endoftext|>, <|im_start|>, <|im_end|>
    workload = random_workload(8, 50, 60, 4, 0, hf_tokenizer.vocab_size, special)
    assert not {t for r in workload.requests for t in r.prompt_token_ids} & special


def test_shared_prefix_workload_shares_a_long_system_prompt(llm):
    tokenizer = llm.engine.tokenizer
    workload = shared_prefix_workload(tokenizer, 8, 16, seed=0)
    again = shared_prefix_workload(tokenizer, 8, 16, seed=0)
    assert [r.prompt_token_ids for r in workload.requests] == [r.prompt_token_ids for r in again.requests]
    assert len({tuple(r.prompt_token_ids) for r in workload.requests}) == 8  # each has its own message
    assert workload.params["shared_prefix_tokens"] >= 300
    assert len(tokenizer.encode(SHARED_SYSTEM_PROMPT, add_special_tokens=False)) >= 300


def test_common_prefix_len_is_what_every_prompt_starts_with():
    requests = [BenchRequest("a", [1, 2, 3, 4], 1), BenchRequest("b", [1, 2, 3], 1),
                BenchRequest("c", [1, 2, 9, 4], 1)]
    assert common_prefix_len(requests) == 2
    assert common_prefix_len(requests[:2]) == 3  # a prompt that is a prefix of the first one
    assert common_prefix_len([BenchRequest("d", [7], 1), BenchRequest("e", [8], 1)]) == 0


def test_chat_workload_reads_messages_or_prompt_columns(tmp_path, llm):
    messages = [[{"role": "user", "content": "Name a colour."}], [{"role": "user", "content": "Count to 3."}]]
    pq.write_table(pa.table({"id": [7, 8], "messages": messages}), tmp_path / "m.parquet")
    pq.write_table(pa.table({"id": ["a"], "prompt": ["Name a colour."]}), tmp_path / "p.parquet")
    assert read_chat_prompts(tmp_path / "p.parquet") == [("a", messages[0])]
    workload = chat_workload(llm.engine.tokenizer, 8, tmp_path / "m.parquet")
    assert [r.request_id for r in workload.requests] == ["chat-7", "chat-8"]
    assert workload.requests[0].prompt_token_ids == llm.engine.encode(messages[0])


# ---- command line -------------------------------------------------------------------------------
def test_engine_overrides_are_typed_and_checked():
    assert parse_engine_overrides(["max_num_seqs=32", "enable_prefix_caching=false", "kv_cache_memory=1GiB"]) == {
        "max_num_seqs": 32, "enable_prefix_caching": False, "kv_cache_memory": "1GiB"}
    with pytest.raises(ValueError, match="unknown engine key"):
        parse_engine_overrides(["max_num_sequences=3"])
    with pytest.raises(ValueError, match="fixed by the bench"):
        parse_engine_overrides(["dtype=bfloat16"])
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_engine_overrides(["max_num_seqs"])


@pytest.mark.parametrize("args, message", [
    (["--engine", "bogus=1"], "unknown engine key"),
    (["--workload", "nope"], "workload must be one of"),
    (["--peer-batch-sizes", "16,x"], "comma-separated integers"),
    (["--quantization", "int8,int3"], "--quantization takes int8, int4; got int3"),
    (["--workload", "copy", "--structured-schema", "s.json"], "--structured-schema runs the random"),
    (["--structured-schema", "/nonexistent/schema.json"], "/nonexistent/schema.json not found"),
])
def test_bad_options_fail_before_any_loading(args, message):
    app = typer.Typer()
    app.command()(bench_command)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    assert message in result.output


def test_structured_schema_runs_constrained_against_unconstrained_interleaved(llm, tmp_path):
    """Every request constrained by the schema (outputs longer than output_len: cut there, as the
    unconstrained side), 2 interleaved runs each on a fresh pool; the ratio and the mask time come back."""
    from batchgen.bench.structured_bench import format_structured_report

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "array", "items": {"type": "integer"}, "minItems": 40}))
    opts = BenchOptions(workload="random", num_requests=3, input_len_min=10, input_len_max=20, output_len=6,
                        seed=0, structured_schema=str(schema), structured_runs=2)
    result = run_bench(opts, engine=llm.engine, say=lambda _: None)
    structured = result["structured"]
    assert [len(structured["runs"][side]) for side in ("unconstrained", "structured")] == [2, 2]
    for side in ("unconstrained", "structured"):
        assert structured["finish_reasons"][side] == {"length": 3}
        assert all(r["completion_tokens"] == 18 for r in structured["runs"][side])
    constrained = structured["runs"]["structured"][0]["structured"]
    assert constrained["num_constrained_requests"] == 3 and constrained["masked_rows_per_step"] == 3
    assert structured["runs"]["unconstrained"][0]["structured"]["num_masked_steps"] == 0
    assert structured["ratio"] == pytest.approx(structured["median_completion_tokens_per_s"]["structured"]
                                                / structured["median_completion_tokens_per_s"]["unconstrained"])
    assert structured["mask_ms_per_step"] > 0 and "median" in format_structured_report(result)
def test_score_workload_agrees_with_hf_and_prints_its_figures(llm, hf_model):
    # A small run of the score bench: the engine's scores against HF's over the same pairs, and the
    # report's ratio; the speed itself is measured by hand (docs/benchmarks/).
    from batchgen.bench.score_bench import NUM_CONTINUATIONS, format_score_report

    opts = BenchOptions(workload="score", num_requests=2, input_len_min=40, input_len_max=40, output_len=3)
    result = run_bench(opts, engine=llm.engine, peer_model=hf_model, say=lambda _: None)
    assert result["agreement"]["num_pairs"] == 2 * NUM_CONTINUATIONS
    assert result["agreement"]["max_abs_sum_diff"] < 1e-3 and result["separate_agreement"]["max_abs_sum_diff"] < 1e-3
    assert result["agreement"]["is_greedy_equal"] == 2 * NUM_CONTINUATIONS
    engine = result["engine"]
    # 40-token contexts: the continuations' forks copy the partial block (39 = 2 blocks + 7) but the last
    assert engine["num_block_copies"] == 2 * (NUM_CONTINUATIONS - 1)
    assert "x the contexts alone" in format_score_report(result)
