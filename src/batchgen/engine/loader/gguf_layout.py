"""A GGUF file's declared layout checked against its length, before the `gguf` package parses it.

`gguf.GGUFReader` trusts every count it reads: an array declared with 2^40 items in a 133-byte file
makes it loop 2^40 times while its lists grow (the reads past the end come back empty, not as
errors). This walk reads the same header (key/value metadata, then tensor infos) with every count
and length checked against the bytes that are left, so a hostile or damaged file is refused in time
proportional to its real length, naming the file, the field and the byte offset.

The same walk reads what the header says (`read_gguf_header`): every scalar and string value, each
array's item type and count (not its items), and the tensors' names. That is all a model's config
needs, so the config is read without gguf.GGUFReader, which parses every array (seconds for a
49k-token vocabulary) and maps every tensor.
"""

from __future__ import annotations

import functools
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

_MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)  # what gguf.GGUFReader reads (version 1 had 32-bit counts)
_DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_ARRAY_DEPTH = 8  # arrays of arrays: none in real files; bounded so a crafted file cannot recurse deeply

# GGUFValueType -> struct format of one scalar item
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, the smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, n_dims, type, offset


class GGUFLayoutError(ValueError):
    """The file's declared counts or sizes do not fit in it (or it is not a GGUF file)."""


class GGUFArray(NamedTuple):
    """A metadata array as the header declares it: its items' GGUF value type and their count."""

    item_type: int
    num_items: int

    @property
    def is_strings(self) -> bool:
        return self.item_type == _STRING


@dataclass(frozen=True)
class GGUFHeader:
    """What a GGUF file declares before its tensor data: metadata values and tensor names, in order."""

    path: Path
    metadata: dict[str, object]  # int | float | bool | str | GGUFArray
    tensor_names: list[str]


class _Walk:
    def __init__(self, buf: mmap.mmap | bytes, size: int, path: Path):
        self.buf, self.size, self.path = buf, size, path
        self.offset = 0
        self.order = "<"

    def fail(self, what: str) -> GGUFLayoutError:
        return GGUFLayoutError(f"GGUF file {self.path} ({self.size} bytes) is damaged or hostile: {what}")

    def take(self, num_bytes: int, what: str) -> int:
        """Claim `num_bytes` at the current offset; the offset where they start."""
        if num_bytes > self.size - self.offset:
            raise self.fail(f"{what} at byte {self.offset} declares {num_bytes} bytes, "
                            f"but only {self.size - self.offset} are left")
        start = self.offset
        self.offset += num_bytes
        return start

    def scalar(self, fmt: str, what: str):
        size = struct.calcsize(fmt)
        return struct.unpack_from(self.order + fmt, self.buf, self.take(size, what))[0]

    def count(self, num_items: int, min_item_bytes: int, what: str) -> None:
        """Refuse a count whose items cannot fit in the rest of the file, before looping over them."""
        if num_items * min_item_bytes > self.size - self.offset:
            raise self.fail(f"{what} at byte {self.offset} declares {num_items} items of at least "
                            f"{min_item_bytes} bytes, but only {self.size - self.offset} bytes are left")

    def string(self, what: str) -> bytes:
        length = self.scalar("Q", f"{what} length")
        start = self.take(length, what)
        return bytes(self.buf[start:start + length])

    def value(self, value_type: int, what: str, depth: int = 0):
        """Walk one value: a scalar or a string is returned, an array as its GGUFArray (items skipped)."""
        if value_type in _SCALAR_FORMATS:
            return self.scalar(_SCALAR_FORMATS[value_type], what)
        if value_type == _STRING:
            return self.string(what).decode("utf-8", errors="replace")
        if value_type != _ARRAY:
            raise self.fail(f"{what} has unknown value type {value_type}")
        if depth >= _MAX_ARRAY_DEPTH:
            raise self.fail(f"{what} nests arrays deeper than {_MAX_ARRAY_DEPTH}")
        item_type = self.scalar("I", f"{what} item type")
        num_items = self.scalar("Q", f"{what} item count")
        if item_type in _SCALAR_FORMATS:
            item_bytes = struct.calcsize(_SCALAR_FORMATS[item_type])
            self.take(num_items * item_bytes, f"{what} ({num_items} items)")
            return GGUFArray(item_type, num_items)
        min_item_bytes = {_STRING: 8, _ARRAY: 12}.get(item_type)
        if min_item_bytes is None:
            raise self.fail(f"{what} has unknown item type {item_type}")
        self.count(num_items, min_item_bytes, what)
        if item_type == _STRING:
            self.skip_strings(num_items, what)
            return GGUFArray(item_type, num_items)
        for i in range(num_items):  # bounded by the bytes left, checked just above
            self.value(item_type, f"{what}[{i}]", depth + 1)
        return GGUFArray(item_type, num_items)

    def skip_strings(self, num_items: int, what: str) -> None:
        """Each item's length checked and its bytes skipped, inlined: a vocabulary holds 50k-150k of them."""
        length_format = struct.Struct(self.order + "Q")
        offset, size = self.offset, self.size
        for i in range(num_items):
            end = offset + 8 + (length_format.unpack_from(self.buf, offset)[0] if size - offset >= 8 else 0)
            if size - offset < 8 or end > size:
                raise self.fail(f"{what}[{i}] at byte {offset} declares more bytes than the "
                                f"{size - offset} left")
            offset = end
        self.offset = offset


def check_gguf_layout(path: str | Path) -> GGUFHeader:
    """Raise GGUFLayoutError unless every count, length and tensor extent the file declares fits in it;
    returns what the header declares."""
    return read_gguf_header(path)


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """The file's metadata and tensor names, every declared size checked (GGUFLayoutError naming the
    file, the field and the byte offset). Cached per (path, modification time, size)."""
    path = Path(path)
    stat = path.stat()
    return _read_header(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _read_header(path: Path, mtime_ns: int, size: int) -> GGUFHeader:
    if size < 4 + 4 + 8 + 8:
        raise GGUFLayoutError(f"GGUF file {path} ({size} bytes) is too short to hold a GGUF header")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return _walk_file(_Walk(buf, size, path))


def _walk_file(walk: _Walk) -> GGUFHeader:
    if walk.buf[:4] != _MAGIC:
        raise walk.fail(f"it does not start with {_MAGIC!r} (found {bytes(walk.buf[:4])!r})")
    walk.offset = 4
    version = walk.scalar("I", "version")
    if version & 0xFFFF == 0:  # written on a machine of the other byte order (gguf.GGUFReader's rule)
        walk.order = ">"
        version = struct.unpack(">I", struct.pack("<I", version))[0]
    if version not in _SUPPORTED_VERSIONS:
        raise walk.fail(f"version {version} is not supported ({', '.join(map(str, _SUPPORTED_VERSIONS))})")
    num_tensors = walk.scalar("Q", "tensor count")
    num_kvs = walk.scalar("Q", "metadata count")
    walk.count(num_kvs, _MIN_KV_BYTES, "metadata")
    alignment = _DEFAULT_ALIGNMENT
    metadata: dict[str, object] = {}
    for _ in range(num_kvs):
        key = walk.string("metadata key").decode("utf-8", errors="replace")
        value_type = walk.scalar("I", f"metadata {key!r} type")
        value = walk.value(value_type, f"metadata {key!r}")
        metadata[key] = value
        if key == "general.alignment" and value_type == 4 and value:
            alignment = value
    walk.count(num_tensors, _MIN_TENSOR_INFO_BYTES, "tensor infos")
    tensors = [_tensor_info(walk) for _ in range(num_tensors)]
    if alignment & (alignment - 1):
        raise walk.fail(f"general.alignment {alignment} is not a power of two")
    data_start = -(-walk.offset // alignment) * alignment
    num_data_bytes = walk.size - data_start
    for name, num_bytes, offset in tensors:
        if offset + num_bytes > num_data_bytes:
            raise walk.fail(f"tensor {name!r} declares bytes {offset}..{offset + num_bytes} of the data "
                            f"section, which holds {max(num_data_bytes, 0)} bytes")
    return GGUFHeader(walk.path, metadata, [name for name, _, _ in tensors])


def _tensor_info(walk: _Walk) -> tuple[str, int, int]:
    """(name, data bytes, offset in the data section) of the next tensor info."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    name = walk.string("tensor name").decode("utf-8", errors="replace")
    num_dims = walk.scalar("I", f"tensor {name!r} dimension count")
    if num_dims > _MAX_DIMS:
        raise walk.fail(f"tensor {name!r} declares {num_dims} dimensions (at most {_MAX_DIMS})")
    dims = [walk.scalar("Q", f"tensor {name!r} dimension") for _ in range(num_dims)]
    raw_type = walk.scalar("I", f"tensor {name!r} type")
    offset = walk.scalar("Q", f"tensor {name!r} offset")
    try:
        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(raw_type)]
    except (ValueError, KeyError):
        raise walk.fail(f"tensor {name!r} has unknown type {raw_type}") from None
    num_elements = 1
    for dim in dims:
        num_elements *= dim  # Python ints: a crafted shape cannot overflow
    if num_elements % block_size:
        raise walk.fail(f"tensor {name!r} has {num_elements} elements, not a multiple of its block "
                        f"of {block_size}")
    return name, num_elements // block_size * type_size, offset
