"""scripts/gpu_check_fp8.py: imports, and its whole flow runs at toy sizes on the CPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check_fp8.py"


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check_fp8", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_llama3_8b_shapes():
    script = load_script()
    assert script.layer_shapes(script.llama3_8b_config()) == {
        "qkv_proj": (4096, 4096 + 2 * 1024), "o_proj": (4096, 4096),
        "gate_up_proj": (4096, 2 * 14336), "down_proj": (14336, 4096)}


def test_tiny_run_on_cpu(tmp_path):
    script = load_script()
    out = tmp_path / "fp8.json"
    result = script.run(script.parse_args(["--tiny", "--quiet", "--device", "cpu", "--json-out", str(out)]))
    assert out.exists() and result["all_matmuls_ok"]
    assert result["fp8_summary"]["fp8_mode"] == "w8a16"  # auto on the CPU
    assert set(result["decode_tokens_per_s"]) == {"float32", "fp8 w8a16"}
    assert all(v > 0 for side in result["decode_tokens_per_s"].values() for v in side.values())
    assert 0 < result["logits_rel_drift"]["w8a16"] < 0.1
