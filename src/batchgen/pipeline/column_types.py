"""One type per output column across all input files, or a bad job naming both files.

The id column and the kept columns are copied into the output; if one file stores ids as int64 and
another as strings, the output folder could not be read as one dataset (pyarrow and polars refuse).
Types that convert without loss are merged (integers to the widest, signed when any is; floats to the
widest; string and large_string to large_string; binary likewise); anything else is refused.
"""

from __future__ import annotations

import pyarrow as pa

from batchgen.pipeline.errors import JobError
from batchgen.pipeline.input_file import InputFile

_STRINGS = (pa.string(), pa.large_string(), pa.string_view())
_BINARIES = (pa.binary(), pa.large_binary(), pa.binary_view())


def unify_column_types(files: list[InputFile], columns: dict[str, str]) -> dict[str, pa.DataType]:
    """{column: the one type every file's values convert to}; `columns` maps each name to its job key."""
    types = {}
    for name, key in columns.items():
        first = files[0]
        merged = first.schema.field(name).type
        for file in files[1:]:
            t = file.schema.field(name).type
            result = merge_types(merged, t)
            if result is None:
                culprit = next((f for f in files if merge_types(f.schema.field(name).type, t) is None), first)
                raise JobError(
                    f"{key}: column {name!r} is {culprit.schema.field(name).type} in {culprit.display} but {t} in "
                    f"{file.display}; the files of one job need types that convert without loss (integers of any "
                    "width, floats, string/large_string): convert the files to one type")
            merged = result
        types[name] = merged
    return types


def merge_types(a: pa.DataType, b: pa.DataType) -> pa.DataType | None:
    """The type both convert to without loss, or None."""
    if a == b:
        return a
    if pa.types.is_integer(a) and pa.types.is_integer(b):
        return _merge_integers(a, b)
    if pa.types.is_floating(a) and pa.types.is_floating(b):
        return a if a.bit_width >= b.bit_width else b
    for family, large in ((_STRINGS, pa.large_string()), (_BINARIES, pa.large_binary())):
        if a in family and b in family:
            return large
    return None


def _merge_integers(a: pa.DataType, b: pa.DataType) -> pa.DataType | None:
    signed = pa.types.is_signed_integer(a) or pa.types.is_signed_integer(b)
    if not signed:
        return a if a.bit_width >= b.bit_width else b
    # A signed type holds an unsigned one only when it is wider.
    need = max(x.bit_width * 2 if pa.types.is_unsigned_integer(x) else x.bit_width for x in (a, b))
    return {8: pa.int8(), 16: pa.int16(), 32: pa.int32(), 64: pa.int64()}.get(need)
