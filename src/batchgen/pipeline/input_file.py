"""One input file as the pipeline sees it, whatever its format, and how much a read yields at a time.

reader.py reads Parquet shards and batch_file.py OpenAI batch files into the same batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

BATCH_SIZE = 1024  # rows per decoded batch at most
BATCH_BYTES = 8 << 20  # and about this many decoded bytes: rows of 1 MB come 8 at a time


@dataclass(frozen=True)
class InputFile:
    """One input file (a Parquet shard, or an OpenAI batch file): where it is, its rows and columns."""

    path: str  # filesystem path (no protocol)
    display: str  # as the user would name it in a message
    num_rows: int
    schema: pa.Schema
    format: str = "parquet"  # or "openai_batch" (batch_file.py reads those)
