"""Hostile or damaged GGUF files: declared counts and sizes are checked against the file before parsing.

gguf.GGUFReader trusts every count it reads: a 133-byte file declaring a 2^40-item array made it
loop (and grow) for hours, from `batchgen run` and from `batchgen plan`.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from batchgen.engine.loader.gguf_layout import GGUFLayoutError, check_gguf_layout
from batchgen.engine.loader.gguf_loader import read_gguf_config

ARRAY, UINT8, STRING, UINT32 = 9, 0, 8, 4


def gguf_header(num_tensors: int, num_kvs: int, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, num_tensors, num_kvs)


def gguf_string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def array_bomb(path, num_items: int = 2**40, item_type: int = UINT8):
    """A 133-byte file: one metadata key whose array declares `num_items` items."""
    body = gguf_header(0, 1) + gguf_string("tokenizer.ggml.scores") + struct.pack("<IIQ", ARRAY, item_type, num_items)
    path.write_bytes(body + b"\0" * (133 - len(body)))
    return path


def small_valid_gguf(path):
    """A real (gguf.GGUFWriter) file: two F32 tensors and a string array."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc"])
    writer.add_tensor("token_embd.weight", np.arange(64, dtype=np.float32).reshape(8, 8))
    writer.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_2_pow_40_item_array_is_refused_in_well_under_a_second(tmp_path):
    path = array_bomb(tmp_path / "bomb.gguf")
    assert path.stat().st_size == 133
    start = time.monotonic()
    with pytest.raises(ValueError, match="bomb.gguf") as info:
        read_gguf_config(path)
    assert time.monotonic() - start < 1.0
    assert "tokenizer.ggml.scores" in str(info.value) and "1099511627776" in str(info.value)


@pytest.mark.parametrize("item_type", [STRING, ARRAY])
def test_arrays_of_strings_or_arrays_are_refused_before_their_items_are_walked(tmp_path, item_type):
    path = array_bomb(tmp_path / "bomb.gguf", item_type=item_type)
    start = time.monotonic()
    with pytest.raises(GGUFLayoutError, match="declares 1099511627776 items"):
        check_gguf_layout(path)
    assert time.monotonic() - start < 1.0


@pytest.mark.parametrize("case, message", [
    ("huge tensor count", "tensor infos"),
    ("huge metadata count", "metadata at byte 24"),
    ("string past the end", "declares 1000000 bytes"),
    ("five dimensions", "5 dimensions"),
    ("tensor past the end", "of the data section"),
    ("not gguf", "does not start with b'GGUF'"),
    ("version 1", "version 1 is not supported"),
])
def test_declared_sizes_that_do_not_fit_are_refused(tmp_path, case, message):
    path = tmp_path / "bad.gguf"
    if case == "huge tensor count":
        data = gguf_header(2**50, 0)
    elif case == "huge metadata count":
        data = gguf_header(0, 2**50)
    elif case == "string past the end":
        data = gguf_header(0, 1) + struct.pack("<Q", 1_000_000) + b"key"
    elif case == "five dimensions":
        data = gguf_header(1, 0) + gguf_string("w") + struct.pack("<I5QIQ", 5, 1, 1, 1, 1, 1, 0, 0)
    elif case == "tensor past the end":
        full = small_valid_gguf(tmp_path / "full.gguf").read_bytes()
        data = full[:-16]  # the last tensor's bytes cut short
    elif case == "not gguf":
        data = b"PK\x03\x04" + b"\0" * 60
    else:
        data = gguf_header(0, 0, version=1)
    path.write_bytes(data + b"\0" * 8)
    with pytest.raises(GGUFLayoutError, match=message) as info:
        check_gguf_layout(path)
    assert str(path) in str(info.value)


def test_well_formed_files_pass(tmp_path, smollm_path):
    check_gguf_layout(small_valid_gguf(tmp_path / "ok.gguf"))
    start = time.monotonic()
    check_gguf_layout(smollm_path)  # 49k-token vocabulary and merges: walked, not parsed
    assert time.monotonic() - start < 2.0


# A fresh interpreter, so its peak RSS (VmHWM) is this read's alone; the timeout bounds a regression.
READ_BOMB = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from batchgen.engine.loader.gguf_loader import read_gguf_config

    def status_bytes(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status_bytes("VmRSS")
    try:
        read_gguf_config(Path(sys.argv[1]))
        error = None
    except ValueError as exc:
        error = str(exc)
    print(json.dumps({"error": error, "growth": status_bytes("VmHWM") - before}))
""")


@pytest.mark.subprocess
def test_the_refusal_does_not_grow_memory(tmp_path):
    path = array_bomb(tmp_path / "bomb.gguf")
    result = subprocess.run([sys.executable, "-c", READ_BOMB, str(path)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["error"] and "bomb.gguf" in report["error"]
    assert report["growth"] < 50e6, report


def test_plan_and_run_refuse_the_file_as_a_bad_job(tmp_path):
    from batchgen.cli.main import app

    path = array_bomb(tmp_path / "bomb.gguf")
    start = time.monotonic()
    plan = CliRunner().invoke(app, ["plan", str(path), "--json"])
    assert plan.exit_code == 2 and "bomb.gguf" in plan.output, plan.output
    pq.write_table(pa.table({"id": [1], "prompt": ["hi"]}), tmp_path / "in.parquet")
    (tmp_path / "job.yaml").write_text(json.dumps({
        "name": "bomb", "model": {"path": str(path)}, "engine": {"device": "cpu"},
        "input": {"path": str(tmp_path / "in.parquet"), "apply_chat_template": False},
        "output": {"path": str(tmp_path / "out")}}))
    run = CliRunner().invoke(app, ["run", str(tmp_path / "job.yaml"), "--no-progress"])
    assert run.exit_code == 2 and "bomb.gguf" in run.output, run.output
    assert time.monotonic() - start < 10.0


def test_the_header_says_what_gguf_reader_reads(smollm_path):
    """Metadata values, array item types and counts, and tensor names as gguf.GGUFReader (the gguf
    package's own parser) reads them; the model's config comes from them alone."""
    from batchgen.engine.loader.gguf_layout import GGUFArray, read_gguf_header
    from batchgen.engine.loader.gguf_loader import _reader

    header = read_gguf_header(smollm_path)
    reader = _reader(smollm_path)  # gguf.GGUFReader, the one the weights are read with (cached)
    assert list(header.metadata) == [k for k in reader.fields if not k.startswith("GGUF.")]
    for key, value in header.metadata.items():
        field = reader.fields[key]
        if isinstance(value, GGUFArray):
            assert (value.item_type, value.num_items) == (int(field.types[1]), len(field.data)), key
        else:
            assert value == field.contents(), key
    assert header.tensor_names == [t.name for t in reader.tensors]
    config = read_gguf_config(smollm_path)
    assert config.vocab_size == len(reader.fields["tokenizer.ggml.tokens"].data) == 49152
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (30, 9, 3)
