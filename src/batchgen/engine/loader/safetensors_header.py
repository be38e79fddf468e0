"""A .safetensors file's header checked against the file's length before anything else reads it.

Layout: an 8-byte little-endian header length N, N bytes of JSON ({name: {dtype, shape,
data_offsets: [begin, end]}, "__metadata__": {...}}), then the data section. The safetensors
library checks this too, but its errors name no file and are not ValueErrors; this check runs
first, reads at most the header, and says which file and which tensor is wrong.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own bound
# Bits per element of each safetensors dtype.
_DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16, "F16": 16,
    "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64, "C64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}


class SafetensorsHeaderError(ValueError):
    """The header does not describe tensors that lie inside the file."""


def check_safetensors_header(path: str | Path) -> None:
    """Raise SafetensorsHeaderError unless the header's length and every tensor's extent fit the file."""
    path = Path(path)
    size = path.stat().st_size

    def fail(what: str) -> SafetensorsHeaderError:
        return SafetensorsHeaderError(f"safetensors file {path} ({size} bytes) is damaged or hostile: {what}")

    if size < 8:
        raise fail("shorter than its 8-byte header length")
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > size - 8:
            raise fail(f"its header declares {header_len} bytes, but only {size - 8} follow")
        if header_len > MAX_HEADER_BYTES:
            raise fail(f"its header declares {header_len} bytes (at most {MAX_HEADER_BYTES})")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise fail(f"its header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise fail("its header is not a JSON object")
    num_data_bytes = size - 8 - header_len
    for name, info in header.items():
        if name == "__metadata__":
            continue
        _check_tensor(name, info, num_data_bytes, fail)


def _check_tensor(name: str, info, num_data_bytes: int, fail) -> None:
    if not isinstance(info, dict):
        raise fail(f"tensor {name!r}: entry is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in _DTYPE_BITS:
        raise fail(f"tensor {name!r}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise fail(f"tensor {name!r}: shape {shape!r} is not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise fail(f"tensor {name!r}: data_offsets {offsets!r} is not [begin, end]")
    begin, end = offsets
    if not 0 <= begin <= end <= num_data_bytes:
        raise fail(f"tensor {name!r}: data_offsets [{begin}, {end}] lie outside the data section "
                   f"of {num_data_bytes} bytes")
    num_bits = _DTYPE_BITS[dtype]
    for dim in shape:
        num_bits *= dim  # Python ints: a crafted shape cannot overflow
    if num_bits != 8 * (end - begin):
        needed = str(num_bits // 8) if num_bits % 8 == 0 else str(num_bits / 8)
        raise fail(f"tensor {name!r}: {dtype} {shape} needs {needed} bytes, "
                   f"its data_offsets span {end - begin}")
