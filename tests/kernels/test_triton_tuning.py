"""Every candidate configuration of kernels/triton_tuning.py computes its kernel's torch reference, under
TRITON_INTERPRET=1 at small shapes (the interpreter ignores warps and stages, and its timings mean
nothing: which candidate is fastest awaits a GPU). Candidates differing only in warps or stages run
once. float16/float32 only: bfloat16 tl.dot is wrong in the interpreter.
"""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels import triton_tuning
from batchgen.kernels.fp8_matmul import fp8_w8a16_matmul
from batchgen.kernels.reference import fp8_w8a16_matmul_ref, int_weight_matmul_ref
from batchgen.kernels.triton_int_matmul import int_weight_matmul, pack_codes
from batchgen.kernels.triton_tuning import AttentionTiles, attention_candidates, gemm_candidates
from tests.kernels.test_triton_paged_attention import assert_close_to_reference, make_step

pytestmark = pytest.mark.triton


def distinct(candidates, *fields):
    """One candidate per distinct value of `fields` (what the interpreter computes with)."""
    seen = {}
    for c in candidates:
        seen.setdefault(tuple(getattr(c, f) for f in fields), c)
    return list(seen.values())


# (head size, query heads, KV heads, dtype, cache dtype)
ATTENTION_KEYS = [(64, 8, 2, torch.float16, None), (64, 4, 1, torch.float32, None),
                  (256, 4, 2, torch.float16, None), (128, 8, 2, torch.float16, torch.float8_e4m3fn)]


@pytest.mark.parametrize("head_size,num_q_heads,num_kv_heads,dtype,cache_dtype", ATTENTION_KEYS,
                         ids=["f16-d64-gqa4", "f32-d64-gqa4", "f16-d256", "fp8-d128"])
def test_every_attention_candidate_matches_the_reference(head_size, num_q_heads, num_kv_heads, dtype, cache_dtype):
    group = num_q_heads // num_kv_heads
    candidates = attention_candidates(head_size, group, dtype, cache_dtype is not None)
    assert candidates[0].block_m >= group and len(set(candidates)) == len(candidates)
    # Two decodes past one chunk and a chunk over a cached prefix: every tile width sees several tiles.
    step = make_step([1, 1, 6], [70, 20, 40], num_q_heads, num_kv_heads, head_size, dtype=dtype,
                     cache_dtype=cache_dtype, seed=head_size)
    for tiles in distinct(candidates, "block_m", "tile_n"):
        out = step.run(tiles=tiles, split_size=128)
        assert_close_to_reference(step, out)
        assert torch.equal(step.run_split(128, 1, tiles=tiles), out), tiles  # split mode: the same bits


def test_wide_query_groups_take_a_block_of_the_groups_width():
    assert attention_candidates(128, 20, torch.float16)[0].block_m == 32
    with pytest.raises(ValueError, match="power of two"):
        AttentionTiles(16, 48)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_every_fp8_gemm_candidate_matches_the_reference(dtype):
    gen = torch.Generator().manual_seed(3)
    n, k = 40, 160  # K spans several tiles of every candidate width
    q = (torch.randn(n, k, generator=gen) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(n, generator=gen) * 0.01 + 0.001
    for m in (3, 20, 70):  # the decode, middle and prefill buckets
        x = torch.randn(m, k, generator=gen).to(dtype)
        ref = fp8_w8a16_matmul_ref(x, q, scale).float()
        candidates = gemm_candidates(m, k, "fp8", dtype)
        assert all(c.block_k >= 64 for c in candidates if dtype == torch.float16)  # K allows it
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        for tiles in distinct(candidates, "block_m", "block_n", "block_k"):
            out = fp8_w8a16_matmul(x, q, scale, tiles=tiles).float()
            torch.testing.assert_close(out, ref, rtol=tol, atol=tol * ref.abs().max().item(), msg=str(tiles))


@pytest.mark.parametrize("bits", [4, 8])
def test_every_int_gemm_candidate_matches_the_reference(bits):
    gen = torch.Generator().manual_seed(bits)
    n, k, group = 40, 160, 32
    codes = torch.randint(0, 2**bits, (n, k), generator=gen, dtype=torch.uint8)
    scales = torch.rand(n, k // group, generator=gen) * 0.02 + 0.001
    zeros = torch.randint(0, 2**bits, (n, k // group), generator=gen).float()
    for m in (3, 20, 70):
        x = torch.randn(m, k, generator=gen)
        ref = int_weight_matmul_ref(x, codes, scales, zeros, group)
        for tiles in distinct(gemm_candidates(m, k, f"int{bits}", torch.float32), "block_m", "block_n", "block_k"):
            out = int_weight_matmul(x, pack_codes(codes, bits), scales, zeros, bits, group, tiles=tiles)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item(), msg=str(tiles))


def test_block_k_never_exceeds_the_matrix_and_the_first_candidate_runs_unless_autotuned(monkeypatch):
    assert {c.block_k for c in gemm_candidates(1, 40, "fp8", torch.float16)} == {64}  # K = 40: one tile of 64
    monkeypatch.delenv(triton_tuning.AUTOTUNE_ENV, raising=False)
    calls = []
    assert triton_tuning.choose(("test-key",), ["first", "second"], calls.append) == "first" and calls == []
