"""A job with `model.quantization: fp8` through `batchgen run`, end to end on the CPU."""

from __future__ import annotations

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
from typer.testing import CliRunner

from batchgen.cli.main import app
from batchgen.engine import LLM, SamplingParams
from tests.engine.fp8_tiny import write_tiny_llama

PROMPTS = ["t5 t17 t33 t9", "t7 t7 t120", "t200 t41"]
MAX_TOKENS = 6


def test_fp8_job_runs_end_to_end_and_matches_the_fp8_engine(tmp_path, caplog):
    model, _ = write_tiny_llama(tmp_path / "tiny")
    pq.write_table(pa.table({"id": [10, 11, 12], "prompt": PROMPTS}), tmp_path / "prompts.parquet")
    (tmp_path / "job.yaml").write_text(json.dumps({  # JSON is YAML
        "name": "fp8-job",
        "model": {"path": str(model), "dtype": "float32", "quantization": "fp8", "fp8_mode": "w8a8",
                  "max_model_len": 128},
        "engine": {"device": "cpu", "kv_cache_memory": "16MiB"},
        "input": {"path": "prompts.parquet", "prompt_column": "prompt", "apply_chat_template": False},
        "sampling": {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True},
        "output": {"path": "out"},
    }))
    with caplog.at_level(logging.INFO, logger="batchgen.engine"):
        result = CliRunner().invoke(app, ["run", str(tmp_path / "job.yaml"), "--json", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert any("matmul path w8a8" in r.getMessage() for r in caplog.records)  # the chosen path is logged

    rows = pa.concat_tables([pq.read_table(p) for p in sorted((tmp_path / "out").glob("part-*.parquet"))])
    assert rows.column("id").to_pylist() == [10, 11, 12]
    assert rows.column("finish_reason").to_pylist() == ["length"] * 3
    weights = json.loads((tmp_path / "out" / "_SUCCESS").read_text())["weights"]  # the format and linear bytes
    assert (weights["format"], weights["origin"], weights["num_linear_layers"]) == ("fp8", "at load", 8)
    assert 0.25 < weights["linear_bytes_vs_float32"] < 0.27  # 1 byte + a float32 scale per row of 64 or 128
    # The job's completions are the FP8 engine's own (W8A8 through torch._scaled_mm on the CPU).
    llm = LLM(str(model), dtype="float32", device="cpu", quantization="fp8", fp8_mode="w8a8",
              max_model_len=128, kv_cache_memory="16MiB")
    # The job encodes control-token text as text (input.allow_special_tokens: false); this word-level
    # vocabulary holds its special tokens' text inside ordinary words ("t1" in "t17"), so the
    # expected side is given the job's own prompt ids.
    prompt_ids = [llm.engine.encode(p, allow_special_tokens=False) for p in PROMPTS]
    expected = llm.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert rows.column("completion_token_ids").to_pylist() == [o.outputs[0].token_ids for o in expected]
