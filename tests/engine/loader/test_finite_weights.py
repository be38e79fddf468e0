"""Damaged weights are an error naming the tensor: `run` refuses to start, `validate --weights` exits 2,
and the kept-block (quantization: gguf) path checks its scales. Before, a GGUF with 1 MB of 0xFF over
its tensor data loaded, and the job wrote empty completions with `cumulative_logprob: NaN`, exit 0."""

from __future__ import annotations

import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from batchgen.engine.loader import finite_weights
from batchgen.engine.loader.finite_weights import NonFiniteWeightError, count_non_finite

DAMAGED_TENSOR = "blk.3.ffn_down.weight"  # model.layers.3.mlp.down_proj.weight in HF's names


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn])
def test_the_count_finds_every_nan_and_infinity(dtype, monkeypatch):
    monkeypatch.setattr(finite_weights, "CHUNK_ELEMENTS", 7)  # values on both sides of chunk boundaries
    values = torch.linspace(-2, 2, 50)
    values[[0, 6, 7, 20, 49]] = float("nan")
    if dtype != torch.float8_e4m3fn:  # e4m3fn has no infinity: it saturates to NaN
        values[[13, 14]] = torch.tensor([float("inf"), float("-inf")])
    expected = int((~torch.isfinite(values)).sum())
    assert count_non_finite(values.to(dtype)) == expected
    assert count_non_finite(torch.linspace(-2, 2, 50).to(dtype)) == 0


def test_finite_values_whose_sum_overflows_are_not_called_damaged():
    """The fast path sums; a sum that overflows to infinity is recounted value by value."""
    big = torch.full((10,), 3e38, dtype=torch.float32)
    assert not torch.isfinite(big.sum())
    assert count_non_finite(big) == 0
    assert count_non_finite(torch.full((10,), 60000.0, dtype=torch.float16)) == 0
    assert count_non_finite(torch.arange(10)) == 0  # integer tensors hold no NaN


@pytest.fixture(scope="module")
def damaged_gguf(smollm_path, tmp_path_factory):
    """The bundled GGUF with 1 MB of 0xFF over one tensor's data (a float16 0xFFFF is NaN)."""
    import gguf

    path = tmp_path_factory.mktemp("damaged") / "damaged.gguf"
    shutil.copy(smollm_path, path)
    tensor = next(t for t in gguf.GGUFReader(str(smollm_path)).tensors if t.name == DAMAGED_TENSOR)
    with open(path, "r+b") as f:
        f.seek(tensor.data_offset)
        f.write(b"\xff" * min(1 << 20, int(tensor.n_bytes)))
    return path


@pytest.mark.parametrize("quantization, tensor", [
    ("auto", "model.layers.3.mlp.down_proj.weight"),  # dequantized to float as it streams in
    ("gguf", "model.layers.3.mlp.down_proj scales"),  # kept as Q4_1 blocks: their float16 scales
])
def test_loading_a_damaged_gguf_names_the_file_and_tensor(damaged_gguf, quantization, tensor):
    from batchgen.engine.config import EngineConfig
    from batchgen.engine.loader.model_loader import load_model

    with pytest.raises(NonFiniteWeightError) as info:
        load_model(EngineConfig(model=str(damaged_gguf), device="cpu", dtype="float32",
                                kv_cache_memory="16MiB", quantization=quantization))
    assert str(damaged_gguf) in str(info.value) and tensor in str(info.value)


def test_validate_with_weights_and_run_refuse_the_damaged_file(damaged_gguf, tmp_path):
    from batchgen.cli.main import app

    pq.write_table(pa.table({"id": [1, 2], "prompt": ["hi", "hello"]}), tmp_path / "in.parquet")
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps({
        "name": "damaged", "model": {"path": str(damaged_gguf), "max_model_len": 256},
        "engine": {"device": "cpu", "kv_cache_memory": "16MiB"},
        "input": {"path": str(tmp_path / "in.parquet"), "apply_chat_template": False},
        "sampling": {"max_tokens": 4}, "output": {"path": str(tmp_path / "out")}}))
    headers_only = CliRunner().invoke(app, ["validate", str(job)])
    assert headers_only.exit_code == 0, headers_only.output  # the headers are sound: only values are damaged
    checked = CliRunner().invoke(app, ["validate", str(job), "--weights"])
    assert checked.exit_code == 2, checked.output
    assert "model.layers.3.mlp.down_proj.weight" in checked.output and "non-finite" in checked.output
    run = CliRunner().invoke(app, ["run", str(job), "--no-progress"])
    assert run.exit_code == 2 and "model.layers.3.mlp.down_proj.weight" in run.output, run.output
    assert not list((tmp_path / "out").rglob("*.parquet"))  # no row of NaN output was written


def test_validate_with_weights_passes_a_sound_model(smollm_path, tmp_path):
    from batchgen.cli.main import app

    pq.write_table(pa.table({"id": [1], "prompt": ["hi"]}), tmp_path / "in.parquet")
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps({
        "name": "sound", "model": {"path": str(smollm_path), "max_model_len": 256}, "sampling": {"max_tokens": 8},
        "input": {"path": str(tmp_path / "in.parquet")}, "output": {"path": str(tmp_path / "out")}}))
    import gguf

    result = CliRunner().invoke(app, ["validate", str(job), "--weights"])
    assert result.exit_code == 0, result.output
    num_tensors = len(gguf.GGUFReader(str(smollm_path)).tensors)  # every tensor the file holds was read
    assert f"{num_tensors:,} tensors read" in result.output and "every value finite" in result.output
