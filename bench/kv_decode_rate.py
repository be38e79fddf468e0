"""Decode attention on the CPU with a float32 and an FP8 KV cache: time per call and KV bytes read.

One decode step's attention for one layer through the C kernel (kernels/cpu_paged_attention.py) at
the bundled model's attention shape (3 KV heads, 3 query heads each, head_dim 64): `num_rows` rows
of `context_len` tokens each, blocks scattered through the cache as the engine allocates them. The
FP8 cache is read one byte per value through the 256-entry lookup table, so it reads a quarter of
float32's bytes; the figure says what that buys in time on this machine.

CLI: python -m batchgen.bench.kv_decode_rate [--rows 64] [--context 1024] [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from batchgen.kernels import cpu_paged_attention
from batchgen.kernels.cpu_paged_attention import fp8_lookup_table
from batchgen.kernels.kv_formats import quantize_kv


def measure_decode_attention(kv_dtype: torch.dtype, num_rows: int = 64, context_len: int = 1024,
                             num_kv_heads: int = 3, group: int = 3, head_dim: int = 64, block_size: int = 16,
                             repeats: int = 20, seed: int = 0) -> dict:
    """Median seconds of one decode-attention call and the K/V bytes it reads (float32 or FP8 cache)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_row = -(-context_len // block_size)
    num_blocks = num_rows * blocks_per_row
    shape = (num_blocks * block_size, num_kv_heads, head_dim)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    luts: tuple = (None, None)
    if kv_dtype != torch.float32:
        scale = torch.tensor(4.0 / 448.0)
        k, v = quantize_kv(k, kv_dtype, scale), quantize_kv(v, kv_dtype, scale)
        luts = (fp8_lookup_table(kv_dtype, scale), fp8_lookup_table(kv_dtype, scale))
    tables = torch.randperm(num_blocks, generator=gen).to(torch.int32).view(num_rows, blocks_per_row)
    lengths = torch.full((num_rows,), context_len, dtype=torch.int32)
    q = torch.randn(num_rows, num_kv_heads, group, head_dim, generator=gen)
    args = (q, k, v, tables, lengths, block_size, head_dim ** -0.5, *luts)
    cpu_paged_attention.paged_decode_attention(*args)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        cpu_paged_attention.paged_decode_attention(*args)
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    kv_bytes = 2 * num_rows * context_len * num_kv_heads * head_dim * k.element_size()
    return {"kv_dtype": str(kv_dtype).removeprefix("torch."), "num_rows": num_rows, "context_len": context_len,
            "seconds": seconds, "kv_bytes": kv_bytes, "gb_per_s": kv_bytes / seconds / 1e9,
            "num_threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="C decode attention: float32 vs FP8 KV cache")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    results = [measure_decode_attention(dtype, args.rows, args.context, repeats=args.repeats)
               for dtype in (torch.float32, torch.float8_e4m3fn)]
    results[1]["speedup_vs_float32"] = results[0]["seconds"] / results[1]["seconds"]
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
