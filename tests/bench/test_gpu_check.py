"""batchgen.bench.gpu_check: its whole flow at toy sizes on the CPU, with its arithmetic checked."""

from __future__ import annotations

import json

from batchgen.bench import gpu_check


class TickClock:
    """A stand-in for the `time` module: each perf_counter() call is one second after the last."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1.0
        return self.now


def test_tiny_run_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "time", TickClock())
    out = tmp_path / "fp8.json"
    args = gpu_check.parse_args(["--tiny", "--quiet", "--device", "cpu", "--batch-sizes", "1,2",
                                 "--json-out", str(out)])
    result = gpu_check.run(args)
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["all_matmuls_ok"]
    # Every fused layer of the tiny config (hidden 64, 4 heads x 16, 2 KV heads, intermediate 128), as
    # (tokens, in_features, out_features).
    assert [(r["layer"], r["shape"]) for r in result["matmul_errors"]] == [
        ("qkv_proj", [64, 64, 64 + 2 * 32]), ("o_proj", [64, 64, 64]),
        ("gate_up_proj", [64, 64, 2 * 128]), ("down_proj", [64, 128, 64])]
    assert result["fp8_summary"]["fp8_mode"] == "w8a16"  # auto on the CPU
    # Each timed decode loop spans one tick of the clock: tokens/s is batch x steps.
    assert result["decode_tokens_per_s"] == {name: {1: 1 * args.steps, 2: 2 * args.steps}
                                             for name in ("float32", "fp8 w8a16")}
    # Each GEMM timing spans one tick over `repeats` calls.
    assert {(r["dense_us"], r["fp8_us"]) for r in result["gemm_times"]} == {(1e6 / args.repeats,) * 2}
    assert 0 < result["logits_rel_drift"]["w8a16"] < 0.1
