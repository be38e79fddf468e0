"""Decode attention on the CPU with a float32, FP8 or bfloat16 KV cache: time per call and KV bytes read.

One decode step's attention for one layer through the C kernel (kernels/cpu_paged_attention.py) at
the bundled model's attention shape (3 KV heads, 3 query heads each, head_dim 64): `num_rows` rows
of `context_len` tokens each, blocks scattered through the cache as the engine allocates them. The
FP8 cache is read one byte per value through the 256-entry lookup table, so it reads a quarter of
float32's bytes; the figure says what that buys in time on this machine. bfloat16 runs twice: float32
queries (the cache widened by a shift in the kernel) and bfloat16 queries (the model in bfloat16: on
BF16 units both products run on vdpbf16ps, see `decode_rounds_probabilities`).

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
                             repeats: int = 20, seed: int = 0, query_dtype: torch.dtype = torch.float32) -> dict:
    """Median seconds of one decode-attention call and the K/V bytes it reads (float32, FP8 or bfloat16
    cache; float32 or, over a bfloat16 cache, bfloat16 queries)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_row = -(-context_len // block_size)
    num_blocks = num_rows * blocks_per_row
    shape = (num_blocks * block_size, num_kv_heads, head_dim)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    luts: tuple = (None, None)
    if kv_dtype == torch.bfloat16:
        k, v = k.to(kv_dtype), v.to(kv_dtype)
    elif kv_dtype != torch.float32:
        scale = torch.tensor(4.0 / 448.0)
        k, v = quantize_kv(k, kv_dtype, scale), quantize_kv(v, kv_dtype, scale)
        luts = (fp8_lookup_table(kv_dtype, scale), fp8_lookup_table(kv_dtype, scale))
    tables = torch.randperm(num_blocks, generator=gen).to(torch.int32).view(num_rows, blocks_per_row)
    lengths = torch.full((num_rows,), context_len, dtype=torch.int32)
    q = torch.randn(num_rows, num_kv_heads, group, head_dim, generator=gen).to(query_dtype)
    args = (q, k, v, tables, lengths, block_size, head_dim ** -0.5, *luts)
    cpu_paged_attention.paged_decode_attention(*args)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        cpu_paged_attention.paged_decode_attention(*args)
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    kv_bytes = 2 * num_rows * context_len * num_kv_heads * head_dim * k.element_size()
    return {"kv_dtype": str(kv_dtype).removeprefix("torch."), "query_dtype": str(query_dtype).removeprefix("torch."),
            "on_bf16_units": query_dtype == torch.bfloat16
            and cpu_paged_attention.decode_rounds_probabilities(head_dim, block_size), "num_rows": num_rows, "context_len": context_len,
            "seconds": seconds, "kv_bytes": kv_bytes, "gb_per_s": kv_bytes / seconds / 1e9,
            "num_threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="C decode attention: float32 vs FP8 vs bfloat16 KV cache")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    cases = [(torch.float32, torch.float32), (torch.float8_e4m3fn, torch.float32), (torch.bfloat16, torch.float32),
             (torch.bfloat16, torch.bfloat16)]
    results = [measure_decode_attention(kv, args.rows, args.context, repeats=args.repeats, query_dtype=query)
               for kv, query in cases]
    for result in results[1:]:
        result["speedup_vs_float32"] = results[0]["seconds"] / result["seconds"]
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
