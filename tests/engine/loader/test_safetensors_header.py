"""Hostile or damaged .safetensors headers are refused before any tensor is read, naming the file."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from batchgen.engine.loader.hf_loader import iter_hf_weights, safetensors_files
from batchgen.engine.loader.safetensors_header import SafetensorsHeaderError, check_safetensors_header


def write_raw(path, header: dict | bytes, data: bytes = b"", header_len: int | None = None):
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob) if header_len is None else header_len) + blob + data)
    return path


def f32(shape, begin, end):
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, end]}


@pytest.mark.parametrize("header, data, header_len, message", [
    ({}, b"", 2**40, "header declares 1099511627776 bytes, but only 2 follow"),
    ({"w": f32([4], 0, 16)}, b"\0" * 8, None, r"data_offsets \[0, 16\] lie outside the data section of 8 bytes"),
    ({"w": f32([4], 8, 4)}, b"\0" * 16, None, "lie outside"),
    ({"w": f32([4], 0, 8)}, b"\0" * 8, None, r"needs 16 bytes, its data_offsets span 8"),
    ({"w": f32([2**31, 2**31, 2**31], 0, 8)}, b"\0" * 8, None, "needs 39614081257132168796771975168 bytes"),
    ({"w": f32([-1], 0, 0)}, b"", None, "not a list of non-negative integers"),
    ({"w": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, None, "unknown dtype"),
    (b"not json", b"", None, "header is not JSON"),
])
def test_bad_headers_are_refused_naming_the_file(tmp_path, header, data, header_len, message):
    path = write_raw(tmp_path / "model.safetensors", header, data, header_len)
    with pytest.raises(SafetensorsHeaderError, match=message) as info:
        check_safetensors_header(path)
    assert str(path) in str(info.value)
    with pytest.raises(ValueError, match="model.safetensors"):  # through the loader, before any read
        list(iter_hf_weights(tmp_path))


def test_a_file_shorter_than_the_length_field_is_refused(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(SafetensorsHeaderError, match="shorter than its 8-byte header length"):
        safetensors_files(tmp_path)


def test_files_written_by_safetensors_pass_and_load(tmp_path):
    tensors = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16),
               "empty": torch.zeros(0, 5)}
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    check_safetensors_header(tmp_path / "model.safetensors")
    loaded = dict(iter_hf_weights(tmp_path))
    assert set(loaded) == set(tensors) and all(torch.equal(loaded[k], tensors[k]) for k in tensors)
