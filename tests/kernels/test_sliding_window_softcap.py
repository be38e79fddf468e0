"""Sliding-window attention and attention-logit soft-capping in every paged-attention kernel: the C
decode and prefill kernels (each head-size form) and the Triton kernel under the interpreter, against
the float64 torch reference (kernels/reference.py's paged_attention_reference).

The window W follows transformers (masking_utils.sliding_window_overlay): a query at position p sees
keys at positions > p - W. Windows are chosen so that the first key a query sees falls inside a block,
on a block boundary and in a block before the query's tile; the scores are large enough that the
tanh cap bends them (scale x |q.k| well above the cap).
"""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels import cpu_paged_attention
from batchgen.kernels.reference import paged_attention_reference
from tests.kernels.helpers import check_c_decode_bfloat16, scattered_paged_cache

SOFTCAP = 2.0


def _with_window(sliding_window, softcap):
    return dict(sliding_window=sliding_window, softcap=softcap)


def test_reference_window_is_transformers_overlay():
    """The reference's mask is HF's: kv_idx > q_idx - W on top of causal (checked on one sequence)."""
    from transformers.masking_utils import sliding_window_overlay

    seq_len, window = 11, 4
    q = torch.eye(seq_len, 8)[:, None]  # (L, 1, 8) one-hot queries: each score row is a key's column
    k = torch.zeros(seq_len, 1, 8)
    v = torch.arange(seq_len, dtype=torch.float32)[:, None, None].expand(seq_len, 1, 8).contiguous()
    tables = torch.zeros(1, 1, dtype=torch.int32)
    out = paged_attention_reference(q, k, v, tables, torch.tensor([0, seq_len], dtype=torch.int32),
                                    torch.tensor([seq_len], dtype=torch.int32), 1.0, 16, sliding_window=window)
    overlay = sliding_window_overlay(window)
    for p in range(seq_len):  # equal scores: the output is the mean of the positions the query sees
        seen = [kv for kv in range(seq_len) if kv <= p and overlay(0, 0, p, kv)]
        assert out[p, 0, 0].item() == pytest.approx(sum(seen) / len(seen))


@pytest.mark.parametrize("head_dim", [32, 48, 64, 128])  # vector forms (2/4/8 machine vectors) and the general loops
@pytest.mark.parametrize("window,softcap", [(5, None), (16, SOFTCAP), (21, SOFTCAP), (None, SOFTCAP), (200, None)])
def test_c_decode_matches_reference(head_dim, window, softcap):
    num_kv_heads, group, block_size = 2, 3, 16
    lengths = [1, 5, 16, 17, 33, 47, 70]  # a window that starts inside, on and before block boundaries
    k_cache, v_cache, tables, _, _ = scattered_paged_cache(lengths, num_kv_heads, head_dim, block_size, seed=1)
    torch.manual_seed(0)
    q = torch.randn(len(lengths), num_kv_heads, group, head_dim) * 3  # scores well past the cap
    lens = torch.tensor(lengths, dtype=torch.int32)
    scale = head_dim ** -0.5
    got = cpu_paged_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, block_size, scale,
                                                     **_with_window(window, softcap))
    cu = torch.arange(len(lengths) + 1, dtype=torch.int32)
    expected = paged_attention_reference(q.reshape(len(lengths), -1, head_dim), k_cache, v_cache, tables, cu, lens,
                                         scale, block_size, **_with_window(window, softcap))
    assert not got.isnan().any(), "a read outside the row's window or blocks"
    torch.testing.assert_close(got.reshape(expected.shape), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_c_decode_bfloat16_matches_reference(head_dim):
    """bfloat16 queries over a bfloat16 cache (the BF16-unit form where the CPU has one)."""
    check_c_decode_bfloat16(head_dim, softcap=SOFTCAP)


@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (32, 5), (16, 16)])
@pytest.mark.parametrize("window,softcap", [(7, SOFTCAP), (16, None), (33, SOFTCAP)])
def test_c_prefill_matches_reference(head_dim, block_size, window, softcap):
    """Fresh prompts, chunks over cached contexts longer than the window, one long chunk whose rows
    are split across threads."""
    num_kv_heads, group = 2, 3
    chunks = [(40, 0), (1, 50), (16, 16), (9, 3), (130, 45)]  # (queries, cached context)
    lengths = [q + c for q, c in chunks]
    k_cache, v_cache, tables, _, _ = scattered_paged_cache(lengths, num_kv_heads, head_dim, block_size, seed=2)
    torch.manual_seed(0)
    num_tokens = sum(q for q, _ in chunks)
    q = torch.randn(num_tokens, group * num_kv_heads, head_dim) * 3
    out = torch.full_like(q, 7.0)
    as_int = lambda values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
    starts = [sum(n for n, _ in chunks[:i]) for i in range(len(chunks))]
    scale = head_dim ** -0.5
    cpu_paged_attention.paged_prefill_attention(q, k_cache, v_cache, as_int(starts), as_int([n for n, _ in chunks]),
                                                as_int([c for _, c in chunks]), tables, block_size, scale, out,
                                                **_with_window(window, softcap))
    cu = torch.tensor([0] + [n for n, _ in chunks]).cumsum(0).to(torch.int32)
    expected = paged_attention_reference(q, k_cache, v_cache, tables, cu, as_int(lengths), scale, block_size,
                                         **_with_window(window, softcap))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_c_kernels_refuse_bad_window_and_cap():
    cache = torch.zeros(16, 1, 16)
    q = torch.zeros(1, 1, 1, 16)
    args = (q, cache, cache, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 16, 1.0)
    with pytest.raises(ValueError, match="sliding_window"):
        cpu_paged_attention.paged_decode_attention(*args, sliding_window=0)
    with pytest.raises(ValueError, match="softcap"):
        cpu_paged_attention.paged_decode_attention(*args, softcap=-1.0)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window,softcap", [(5, SOFTCAP), (32, None), (None, SOFTCAP)])
def test_triton_matches_reference(dtype, window, softcap):
    """Decodes, a fresh prompt, chunks over cached prefixes (mixed in one step), unsplit and split-KV."""
    from tests.kernels.test_triton_paged_attention import make_step

    step = make_step([1, 1, 1, 40, 9, 16], [15, 33, 70, 40, 50, 48], 4, 2, 64, dtype=dtype, seed=3)
    step.q.mul_(3)
    kwargs = _with_window(window, softcap)
    ref = paged_attention_reference(*step.args(), **kwargs)
    for out in (step.run(**kwargs), step.run_split(32, 3, **kwargs)):
        assert not out.isnan().any(), "a read outside the sequence's slots"
        if dtype == torch.float32:
            torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
        else:
            torch.testing.assert_close(out.float(), ref.float(), atol=2e-3 * ref.abs().max().item(), rtol=1e-2)


@pytest.mark.triton
def test_triton_window_is_batch_invariant():
    """A sequence's rows are bitwise the same alone and in a mixed step, with tiles skipped by the window."""
    from tests.kernels.test_triton_paged_attention import make_step

    step = make_step([1, 40, 9], [70, 40, 50], 4, 2, 64, seed=4)
    kwargs = _with_window(12, SOFTCAP)
    together = step.run(**kwargs)
    for s in range(3):
        alone, rows = step.alone(s)
        assert torch.equal(alone.run(**kwargs), together[rows])
