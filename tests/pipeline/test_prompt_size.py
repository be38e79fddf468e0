"""A prompt over input.max_prompt_bytes becomes an error row before it is tokenized.

A 10 MB prompt used to become a correct (overlong) error row only after the tokenizer had spent
~15 s and ~2.6 GB on it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pyarrow as pa
import pytest

from batchgen.pipeline.job import run_job
from batchgen.pipeline.request_builder import max_prompt_bytes
from tests.pipeline.conftest import make_job, read_output, write_parquet
from tests.pipeline.tiny_model import write_tiny_model

MIB = 1 << 20


def test_the_default_limit_is_max_of_1_mib_and_16_bytes_per_token(tmp_path):
    job = make_job(tmp_path, "in.parquet")
    assert job.input.max_prompt_bytes is None
    assert max_prompt_bytes(job, 256) == MIB
    assert max_prompt_bytes(job, 131072) == 16 * 131072
    assert max_prompt_bytes(make_job(tmp_path, "in.parquet", input={"max_prompt_bytes": 100}), 131072) == 100


def test_prompts_over_the_limit_are_error_rows_and_never_reach_the_tokenizer(tmp_path, fake_engine_for):
    prompts = ["x" * 100, "y" * 101, "é" * 51, "short"]  # "é" is 2 bytes in UTF-8: 102 bytes
    path = write_parquet(tmp_path / "in.parquet", {"id": [1, 2, 3, 4], "prompt": prompts})
    job = make_job(tmp_path, str(path), input={"max_prompt_bytes": 100})
    engine = fake_engine_for(job)
    encoded = []
    real_encode = engine.encode
    engine.encode = lambda prompt, **kwargs: encoded.append(prompt) or real_encode(prompt, **kwargs)
    run_job(job, engine=engine, progress=False)
    rows = {r["id"]: r for r in read_output(tmp_path / "out").to_pylist()}
    assert rows[1]["error"] is None and rows[4]["error"] is None  # exactly at the limit passes
    for row_id, num_bytes in [(2, 101), (3, 102)]:
        assert rows[row_id]["finish_reason"] == "error"
        assert f"the prompt is {num_bytes} bytes, over input.max_prompt_bytes (100)" in rows[row_id]["error"]
        assert rows[row_id]["prompt_tokens"] is None
    assert [m[0]["content"] for m in encoded] == ["x" * 100, "short"]


def test_messages_count_their_roles_and_contents(tmp_path, fake_engine_for):
    messages = pa.array([[{"role": "user", "content": "a" * 40}], [{"role": "user", "content": "b" * 50}]],
                        pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])))
    path = write_parquet(tmp_path / "in.parquet", pa.table({"id": [1, 2], "messages": messages}))
    job = make_job(tmp_path, str(path), input={"prompt_column": None, "messages_column": "messages",
                                               "max_prompt_bytes": 50})
    run_job(job, engine=fake_engine_for(job), progress=False)
    rows = {r["id"]: r for r in read_output(tmp_path / "out").to_pylist()}
    assert rows[1]["error"] is None  # 4 + 40 bytes
    assert "the prompt is 54 bytes, over input.max_prompt_bytes (50)" in rows[2]["error"]


# A fresh interpreter on the tiny model, so its peak RSS (VmHWM) after start-up is this row's alone.
RUN_ONE_ROW = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from batchgen.engine import LLMEngine
    from batchgen.pipeline.config import validate_job
    from batchgen.pipeline.job import run_job
    import pyarrow.parquet as pq

    def status_bytes(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    model, data, out = sys.argv[1:]
    job = validate_job({"name": "big", "model": {"path": model, "dtype": "float32", "max_model_len": 128},
                        "engine": {"device": "cpu", "kv_cache_memory": "16MiB"},
                        "input": {"path": data}, "sampling": {"max_tokens": 2}, "output": {"path": out}}, Path("."))
    engine = LLMEngine(job.engine_config())
    engine.encode([{"role": "user", "content": "warm up"}])  # first-call allocations out of the measure
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status_bytes("VmRSS")
    run_job(job, engine=engine, progress=False)
    growth = status_bytes("VmHWM") - before
    rows = pq.read_table(Path(out) / "part-00000.parquet", columns=["id", "finish_reason", "error"]).to_pylist()
    print(json.dumps({"growth": growth, "rows": rows}))
""")


@pytest.mark.subprocess
def test_a_10_mb_prompt_is_refused_without_tokenizing_it(tmp_path, hf_tokenizer):
    model = write_tiny_model(tmp_path / "model", hf_tokenizer)
    big = "Tell me everything about the history of tea, in detail. " * (10 * MIB // 56)
    assert len(big) > 10e6
    path = write_parquet(tmp_path / "in.parquet", {"id": [1], "prompt": [big]})
    result = subprocess.run([sys.executable, "-c", RUN_ONE_ROW, str(model), str(path), str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    [row] = report["rows"]
    assert row["finish_reason"] == "error"
    assert f"the prompt is {len(big)} bytes, over input.max_prompt_bytes ({MIB})" in row["error"]
    # Reading, decoding and measuring the 10 MB cell keeps a few copies of it (68 MB above a short
    # prompt's run, measured); tokenizing it would take ~1.5 GB more (2.2M tokens, measured alone).
    assert report["growth"] < 150e6, report


@pytest.mark.parametrize("value", [0, -1])
def test_the_limit_must_be_positive(tmp_path, value):
    from batchgen.pipeline.errors import JobError

    with pytest.raises(JobError, match="input.max_prompt_bytes"):
        make_job(tmp_path, "in.parquet", input={"max_prompt_bytes": value})
