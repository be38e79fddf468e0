"""The table printed at the end of the GPU check, from its result dict (the JSON file's contents)."""

from __future__ import annotations


def format_table(result: dict) -> str:
    lines = [f"{'configuration':<32} {'tok/s':>10} {'decode tok/s':>13} {'roofline':>9}  notes"]
    speed = result.get("speed", [])
    for row in speed if isinstance(speed, list) else []:
        if "skipped" in row:
            lines.append(f"{row['name']:<32} {'-':>10} {'-':>13} {'-':>9}  skipped: {row['skipped']}")
            continue
        if "error" in row:
            lines.append(f"{row['name']:<32} {'-':>10} {'-':>13} {'-':>9}  FAILED: {row['error'][:200]}")
            continue
        notes = f"{row['attention_backend']}, graphs {'on' if row['cuda_graphs'] else 'off'}"
        if row.get("cuda_graphs_sizes"):
            notes += (f" ({row['cuda_graphs_sizes']} captured in {row['cuda_graphs_capture_seconds']:.1f} s, "
                      f"{row['cuda_graphs_memory_bytes'] / 2**30:.2f} GiB; reserved "
                      f"{row.get('cuda_graphs_reserved_bytes', 0) / 2**30:.2f} GiB)")
        if "stopped_at_time_limit" in row:
            notes += f", cut short at {row['stopped_at_time_limit']:.0f} s"
        lines.append(f"{row['name']:<32} {row['completion_tokens_per_s']:>10.1f} {row['decode_tokens_per_s']:>13.1f} "
                     f"{row['decode_fraction_of_roofline']:>9.1%}  {notes}")
        if row.get("kv_plan"):
            lines.append(f"{'':<32} KV plan: {row['kv_plan']}")
    if isinstance(speed, dict) and "error" in speed:
        lines.append(f"speed FAILED: {speed['error'][:300]}")
    peer = result.get("peer")
    if peer and "completion_tokens_per_s" in peer:
        lines.append(f"{peer['name']:<32} {peer['completion_tokens_per_s']:>10.1f} {'':>13} {'':>9}  peer")
    t = result.get("tensor_parallel")
    if t and "speed" in t:  # not an error or a skip (those are listed below)
        for row in t["speed"]:
            if "skipped" not in row:
                lines.append(f"{row['name']:<32} {row['completion_tokens_per_s']:>10.1f} "
                             f"{row['decode_tokens_per_s']:>13.1f} {row['decode_fraction_of_roofline']:>9.1%}  "
                             f"per GPU's shard")
        for name in ("float32", "bfloat16"):
            lines.append(f"tensor parallel {name}: {t[name]['identical_requests']}/{t['num_prompts']} requests "
                         f"identical at tp={t['tensor_parallel_size']} and tp=1, {t[name]['matching_tokens']}/"
                         f"{t[name]['num_tokens']} tokens")
    kernels = result.get("kernels") or {}
    attention = kernels.get("decode_attention")
    for row in attention if isinstance(attention, list) else []:
        lines.append(f"decode attention {row['case']}: unsplit {row['unsplit_gb_per_s']:.0f} GB/s "
                     f"({row['unsplit_fraction_of_hbm']:.0%} of HBM), split {row['split_gb_per_s']:.0f} GB/s "
                     f"({row['split_fraction_of_hbm']:.0%}, {row['num_splits']} splits), same bits: "
                     f"{row['split_equals_unsplit_bitwise']}; {row['tiles']}")
        for tiles, rate in row.get("candidates", {}).items():
            lines.append(f"    candidate {tiles}: {rate} GB/s")
    sampler = kernels.get("sampler")
    if sampler:
        ms = sampler["ms"]
        lines.append(f"sampler N={sampler['num_rows']} V={sampler['vocab']}: " + ", ".join(
            f"{name} {value:.2f} ms" + (f" ({sampler['over_greedy'][name]:.2f}x greedy)" if name != "greedy" else "")
            for name, value in ms.items()))
    for name in ("correctness", "fp8_matmuls", "kernels", "peer", "tensor_parallel"):
        part = result.get(name)
        if isinstance(part, dict) and "error" in part:
            lines.append(f"{name} FAILED: {part['error'][:300]}")
    c = result.get("correctness")
    if c and "float32" in c:
        for name in ("float32", "bfloat16"):
            r = c[name]
            lines.append(f"correctness {name}: {r['identical_requests']}/{c['num_prompts']} requests identical to HF, "
                         f"{r['matching_tokens']}/{r['num_tokens']} tokens ({r['attention_backend']})")
    m = result.get("fp8_matmuls")
    if isinstance(m, list):
        lines.append("fp8 matmuls: " + ", ".join(f"{r['layer']} w8a8 {r['w8a8']:.4f} w8a16 {r['w8a16']:.4f}"
                                                 for r in m))
    if result.get("part_seconds"):
        lines.append("seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in result["part_seconds"].items()))
    return "\n".join(lines)
