"""Text rendering of a bench result dict (the same dict `--json` prints)."""

from __future__ import annotations

BUSY_CPU_FRACTION = 0.25  # of all CPUs, busy while the bench idled just before starting


def _row(label: str, side: dict) -> str:
    return (f"  {label:<34} {side['prompt_tokens']:>14,} {side['completion_tokens']:>18,} "
            f"{side['seconds']:>9.2f} {side['completion_tokens_per_s']:>17.1f}")


def format_report(result: dict) -> str:
    """A human-readable table of the figures in `result`."""
    w, m = result["workload"], result["machine"]
    lines = [
        (f"batchgen bench: workload {w['name']}: {w['num_requests']} requests, prompts "
        f"{w['prompt_len_min']}-{w['prompt_len_max']} tokens, output {w.get('output_len', '?')} tokens"),
        (f"  model {result['model']} ({result.get('dtype', 'float32')}), {m['num_threads']} torch threads on "
        f"{m['cpu']} ({m['num_cpus']} CPUs), CPU ISA {result.get('kernels', {}).get('cpu_isa', '?')}"),
        "",
        f"  {'':<34} {'prompt tokens':>14} {'completion tokens':>18} {'seconds':>9} {'completion tok/s':>17}",
    ]
    engines = result["engine_runs"]
    for side in engines.values():
        lines.append(_row(side["name"], side))
    peer = result.get("peer")
    if peer:
        lines.append(_row(peer["name"], peer))
        if "runs" in peer:  # HF: its batch sizes
            others = ", ".join(f"batch {r['batch_size']}: {r['completion_tokens_per_s']:.1f}/s" for r in peer["runs"])
            lines.append(f"  (peer tried {others})")
        if "load_seconds" in peer:  # vLLM: load + compile untimed, repetitions
            reps = ", ".join(f"{r['seconds']:.2f} s" for r in peer["reps"])
            lines.append(f"  (peer {peer['versions'].get('vllm', '?')}: load + compile {peer['load_seconds']:.1f} s "
                         f"and warm-up {peer['warmup_seconds']:.1f} s untimed; repetitions {reps})")
    lines.append("")
    if peer:
        lines.append(f"  ratio engine / peer (completion tokens/s): {result['ratio_vs_peer']:.2f}x")
    if "ratio_prefix_caching" in result:
        lines.append(f"  ratio prefix caching on / off: {result['ratio_prefix_caching']:.2f}x "
                     f"(shared prefix {w.get('shared_prefix_tokens', '?')} tokens; cache hit rate "
                     f"{engines['engine']['prefix_cache_hit_rate']:.1%} of prompt tokens)")
    for method, ratio in result.get("ratio_quantized", {}).items():
        weights = engines[f"engine_{method}"].get("weights", {})
        share = f", linear layers {weights['linear_bytes_vs_float32']:.1%} of float32 bytes" if weights else ""
        lines.append(f"  ratio {method} / float32 weights (completion tokens/s): {ratio:.2f}x{share}")
    moe = result.get("moe")
    if moe:
        lines.append(f"  MoE: {moe['num_experts']} experts, top {moe['num_experts_per_tok']}, hidden {moe['hidden_size']}, "
                     f"experts {moe['moe_intermediate_size']} wide, {moe['num_moe_layers']} of {moe['num_layers']} "
                     f"layers; {moe['num_active_layer_params_per_token'] / 1e6:.1f}M layer weights read per token "
                     f"of {moe['num_expert_params'] / 1e6:.1f}M expert weights resident")
        lines.append(f"  fused MoE layers: {moe['moe_seconds']:.2f} s of the engine's {engines['engine']['seconds']:.2f} s "
                     f"({moe['moe_share_of_run']:.1%} of the run; {moe['num_moe_calls']} layer calls)")
    g = result["gemm"]
    lines.append(f"  GEMM {g.get('dtype', 'float32')}: {g['prefill']['gflops_per_s']:.1f} GFLOP/s at prefill shapes "
                 f"({g['prefill']['num_tokens']} rows), {g['decode']['gflops_per_s']:.1f} GFLOP/s at decode "
                 f"shapes ({g['decode']['num_tokens']} rows)")
    r = result["roofline"]
    lines.append(f"  roofline: {r['num_flops'] / 1e12:.3f} TFLOP of linears -> {r['seconds']:.2f} s, "
                 f"{r['completion_tokens_per_s']:.1f} completion tokens/s; engine at "
                 f"{result['fraction_of_roofline']:.1%} of roofline")
    if "ratio_prefix_caching" in result:
        lines.append("  (the roofline counts every prompt token, as if nothing were cached)")
    for label, a in result.get("agreement", {}).items():
        lines.append(f"  greedy agreement {label}: {a['num_exact']}/{a['num_requests']} requests identical, "
                     f"mean matching prefix {a['mean_prefix_len']:.1f} of {a['mean_output_len']:.1f} tokens")
    busy = m.get("cpu_busy_before")
    if busy is not None and busy > BUSY_CPU_FRACTION:
        # Other processes' threads fight ours for the cores (OpenMP threads spin at barriers): the
        # figures above then say more about the neighbours than about either side.
        lines.append(f"  WARNING: {busy:.0%} of the CPUs were busy with other work just before the run; "
                     "rerun on a quiet machine before recording these figures")
    if not result["is_fair"]:
        lines.append("  WARNING: the sides did not process the same tokens: " + "; ".join(result["unfair_reasons"]))
    return "\n".join(lines)
