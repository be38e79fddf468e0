"""Kernel-test helpers: fresh loaders and planted libraries for the C-kernel loader, a paged cache
with scattered blocks, rotary tables."""

from __future__ import annotations

import subprocess
from pathlib import Path

import torch

from batchgen.kernels.c_library import CLibrary


def fresh_library(library: CLibrary, **functions: tuple) -> CLibrary:
    """A loader for the same sources that has not tried to load yet (`functions` adds exports)."""
    return CLibrary(library.name, library.sources, {**library.functions, **functions}, library.fallback,
                    headers=library.headers)


def plant_library(path: Path, marker: Path, exports: tuple[str, ...]) -> None:
    """Build an attacker's shared library at `path`: its constructor writes `marker` when it is
    loaded, and it exports `exports` (doing nothing) so that binding them would succeed."""
    source = path.parent / "planted.c"
    functions = "".join(f"void {name}(void) {{}}\n" for name in exports)
    source.write_text(
        "#include <stdio.h>\n"
        f"__attribute__((constructor)) static void plant(void) {{ FILE *f = fopen(\"{marker}\", \"w\");"
        " if (f) { fputs(\"ran\", f); fclose(f); } }\n" + functions)
    subprocess.run(["cc", "-shared", "-fPIC", str(source), "-o", str(path)], check=True, capture_output=True)
    source.unlink()


def scattered_paged_cache(lengths: list[int], num_kv_heads: int, head_dim: int, block_size: int, seed: int):
    """Caches full of NaN except the rows' own tokens, in blocks scattered through the cache.
    Returns (k_cache, v_cache (slots, Hkv, D), block tables (rows, max_blocks) int32, each row's keys
    and values (n, Hkv, D) as written)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = [-(-n // block_size) for n in lengths]
    order = torch.randperm(sum(num_blocks) + 5, generator=gen).tolist()  # 5 blocks nobody owns
    tables, keys, values = [], [], []
    k_cache = torch.full(((sum(num_blocks) + 5) * block_size, num_kv_heads, head_dim), float("nan"))
    v_cache = k_cache.clone()
    for n, nb in zip(lengths, num_blocks):
        table = [order.pop() for _ in range(nb)]
        slots = torch.tensor([b * block_size + i for b in table for i in range(block_size)][:n])
        keys.append(torch.randn(n, num_kv_heads, head_dim, generator=gen) * 2)
        values.append(torch.randn(n, num_kv_heads, head_dim, generator=gen))
        k_cache[slots], v_cache[slots] = keys[-1], values[-1]
        tables.append(table + [0] * (max(num_blocks) - nb))
    return k_cache, v_cache, torch.tensor(tables, dtype=torch.int32), keys, values


def rotary_tables(positions: torch.Tensor, head_dim: int, base: float = 10000.0):
    """HF's cos and sin (T, D) for these positions, and the kernels' (T, 1, D) cos and signed_sin
    (sin with its first half negated)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))
    emb = torch.cat([torch.outer(positions.float(), inv_freq)] * 2, dim=-1)
    cos, sin = emb.cos(), emb.sin()
    half = head_dim // 2
    signed_sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
    return cos, sin, cos[:, None].contiguous(), signed_sin[:, None].contiguous()


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, so NaN sentinels compare equal to themselves."""
    return t.contiguous().view(torch.uint8)


def assert_within_one_fp8_step(got: torch.Tensor, expected: torch.Tensor):
    """The interpreter's float32 -> FP8 cast (numpy emulation, not the GPU's instruction) mis-rounds a
    few values: ties go away from zero (one step off), and a value that rounds up to a power of two
    loses its carry and comes out as half of it. Allow those, for a few percent of values only."""
    got_code = bits(got).to(torch.int16)
    expected_code = bits(expected).to(torch.int16)
    is_same = got_code == expected_code
    is_adjacent = ((got_code - expected_code).abs() == 1) & ((got_code ^ expected_code) < 0x80)
    got_value, expected_value = got.float(), expected.float()
    is_lost_carry = (got_value * 2 == expected_value) & (torch.frexp(expected_value).mantissa.abs() == 0.5)
    assert (is_same | is_adjacent | is_lost_carry).all(), "an FP8 value off by more than the interpreter errs"
    assert (~is_same).float().mean() < 0.05


def check_c_decode_bfloat16(head_dim: int, **options) -> torch.Tensor:
    """The C decode kernel's bfloat16 form (bfloat16 queries over a bfloat16 cache, window 19, four rows
    of 3-64 tokens) equals the float32 reference within bfloat16's rounding, with the kernel `options`
    (softcap=..., sinks=a bfloat16 tensor); returns the reference's output."""
    from batchgen.kernels import cpu_paged_attention
    from batchgen.kernels.reference import paged_attention_reference

    num_kv_heads, group, block_size, window = 2, 2, 16, 19
    lengths = [3, 18, 40, 64]
    k32, v32, tables, _, _ = scattered_paged_cache(lengths, num_kv_heads, head_dim, block_size, seed=3)
    k_cache, v_cache = k32.nan_to_num(0.0).bfloat16(), v32.nan_to_num(0.0).bfloat16()
    torch.manual_seed(1)
    q = (torch.randn(len(lengths), num_kv_heads, group, head_dim) * 3).bfloat16()
    lens = torch.tensor(lengths, dtype=torch.int32)
    scale = head_dim ** -0.5
    got = cpu_paged_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, block_size, scale,
                                                     sliding_window=window, **options)
    cu = torch.arange(len(lengths) + 1, dtype=torch.int32)
    reference_options = {k: v.float() if isinstance(v, torch.Tensor) else v for k, v in options.items()}
    expected = paged_attention_reference(q.float().reshape(len(lengths), -1, head_dim), k_cache.float(),
                                         v_cache.float(), tables, cu, lens, scale, block_size,
                                         sliding_window=window, **reference_options)
    torch.testing.assert_close(got.float().reshape(expected.shape), expected, rtol=2e-2, atol=2e-2)
    return expected
