"""A job with `model.quantization: int4` (and the engine with int8) through the loader, end to end on the CPU.

The quality tests quantize copies of an already loaded model; this runs the path a user's job takes:
the loader quantizes at load, the engine reports the weights, `_SUCCESS` carries them.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from typer.testing import CliRunner

from batchgen.cli.main import app
from batchgen.engine import LLM, SamplingParams
from batchgen.engine.kv.capacity import weight_bytes
from batchgen.engine.quant.int_linear import IntLinear
from tests.engine.fp8_tiny import write_tiny_llama

PROMPTS = ["t5 t17 t33 t9", "t7 t7 t120", "t200 t41"]
MAX_TOKENS = 6
ENGINE = dict(dtype="float32", device="cpu", max_model_len=128, kv_cache_memory="16MiB")


def test_int4_job_runs_end_to_end_and_matches_the_int4_engine(tmp_path):
    model, _ = write_tiny_llama(tmp_path / "tiny")
    pq.write_table(pa.table({"id": [10, 11, 12], "prompt": PROMPTS}), tmp_path / "prompts.parquet")
    (tmp_path / "job.yaml").write_text(json.dumps({  # JSON is YAML
        "name": "int4-job",
        "model": {"path": str(model), "dtype": "float32", "quantization": "int4", "max_model_len": 128},
        "engine": {"device": "cpu", "kv_cache_memory": "16MiB"},
        "input": {"path": "prompts.parquet", "prompt_column": "prompt", "apply_chat_template": False},
        "sampling": {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True},
        "output": {"path": "out"},
    }))
    result = CliRunner().invoke(app, ["run", str(tmp_path / "job.yaml"), "--json", "--no-progress"])
    assert result.exit_code == 0, result.output
    rows = pa.concat_tables([pq.read_table(p) for p in sorted((tmp_path / "out").glob("part-*.parquet"))])
    assert rows.column("id").to_pylist() == [10, 11, 12]
    weights = json.loads((tmp_path / "out" / "_SUCCESS").read_text())["weights"]
    assert (weights["format"], weights["origin"], weights["num_linear_layers"]) == ("int4", "at load", 8)
    # Half a byte per weight plus a float32 scale and -z*s per row (K = 64 or 128: one group each)
    # and, activation-aware (the default), a float32 pre-quant scale per input column.
    assert 0.15 < weights["linear_bytes_vs_float32"] < 0.17, weights

    llm = LLM(str(model), quantization="int4", **ENGINE)
    assert llm.engine.stats["weights"] == weights
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, IntLinear)]
    assert len(layers) == 8 and all(m.bits == 4 and m.group_size == 128 for m in layers)
    assert all(m.pre_quant_scale is not None for m in layers)
    # K = 64 or 128: every layer's codes are in the block Hadamard basis, and the job ran them.
    assert all(m.hadamard_size == 64 for m in layers) and weights["num_hadamard_rotated_layers"] == 8
    assert weight_bytes(llm.engine.model_cfg, torch.float32, "int4") == llm.engine.weight_bytes
    prompt_ids = [llm.engine.encode(p, allow_special_tokens=False) for p in PROMPTS]
    expected = llm.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert rows.column("completion_token_ids").to_pylist() == [o.outputs[0].token_ids for o in expected]


def test_the_int8_engine_reports_int8_weights_and_the_planners_bytes(tmp_path):
    model, _ = write_tiny_llama(tmp_path / "tiny")
    llm = LLM(str(model), quantization="int8", **ENGINE)
    weights = llm.engine.stats["weights"]
    assert (weights["format"], weights["origin"], weights["num_linear_layers"]) == ("int8", "at load", 8)
    # 1 byte + a float32 scale per row + a float32 pre-quant scale per column (activation-aware)
    assert 0.26 < weights["linear_bytes_vs_float32"] < 0.28, weights
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, IntLinear)]
    assert len(layers) == 8 and all(m.bits == 8 and m.is_symmetric and m.group_size == m.in_features for m in layers)
    assert weight_bytes(llm.engine.model_cfg, torch.float32, "int8") == llm.engine.weight_bytes


def test_a_quantized_lm_head_is_rounded_to_nearest_and_planned_so(tmp_path):
    """quantize_lm_head with activation-aware int4: the decoder layers carry pre-quant scales, lm_head
    (whose calibration rows would be one per window) does not, and the planner counts exactly that."""
    model, _ = write_tiny_llama(tmp_path / "tiny")
    llm = LLM(str(model), quantization="int4", quantize_lm_head=True, **ENGINE)
    lm_head = llm.engine.runner.model.lm_head
    assert isinstance(lm_head, IntLinear) and lm_head.pre_quant_scale is None
    assert llm.engine.stats["weights"]["num_pre_quant_scaled_layers"] == 8
    assert weight_bytes(llm.engine.model_cfg, torch.float32, "int4", quantize_lm_head=True) == llm.engine.weight_bytes
