"""Attention sinks (gpt-oss: a learned logit per query head in the softmax's denominator, weighing no value)
in every paged-attention kernel: the C decode kernel (each head-size form, bfloat16 too) and prefill kernel,
the Triton kernel under the interpreter (unsplit and split-KV, float32/float16), with sliding windows;
all against the float64 torch reference, which is itself checked against transformers' GptOss eager
attention. Sinks are drawn large and small (some above every score, some far below) so that they move
the outputs measurably (asserted against the sink-free result).
"""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels import cpu_paged_attention
from batchgen.kernels.reference import paged_attention_reference
from tests.kernels.helpers import check_c_decode_bfloat16, scattered_paged_cache


def _sinks(num_q_heads: int, seed: int = 5) -> torch.Tensor:
    """Per-head logits from -4 to 6: past the largest scaled scores on some heads, negligible on others."""
    return torch.linspace(-4.0, 6.0, num_q_heads)[torch.randperm(num_q_heads, generator=torch.Generator().manual_seed(seed))]


def test_reference_equals_transformers_gpt_oss_eager_attention():
    """One sequence, GQA 2, a window: the reference with sinks = transformers' eager_attention_forward
    (sink column appended, max subtracted, softmax, column dropped) under HF's sliding-window mask."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    gen = torch.Generator().manual_seed(0)
    seq_len, num_heads, num_kv_heads, head_dim, window = 21, 4, 2, 16, 6
    q = torch.randn(seq_len, num_heads, head_dim, generator=gen) * 2
    k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
    sinks = _sinks(num_heads)
    tables = torch.arange(2, dtype=torch.int32)[None]  # slots 0..31 in order
    k_cache, v_cache = torch.zeros(32, num_kv_heads, head_dim), torch.zeros(32, num_kv_heads, head_dim)
    k_cache[:seq_len], v_cache[:seq_len] = k, v
    ours = paged_attention_reference(q, k_cache, v_cache, tables, torch.tensor([0, seq_len], dtype=torch.int32),
                                     torch.tensor([seq_len], dtype=torch.int32), head_dim ** -0.5, 16,
                                     sliding_window=window, sinks=sinks)
    pos = torch.arange(seq_len)
    seen = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    mask = torch.zeros(seq_len, seq_len).masked_fill(~seen, float("-inf"))[None, None]
    module = SimpleNamespace(num_key_value_groups=num_heads // num_kv_heads, sinks=sinks, training=False)
    hf, _ = eager_attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                    v.transpose(0, 1)[None], mask, head_dim ** -0.5)
    torch.testing.assert_close(ours, hf[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [32, 48, 64, 128])  # vector forms (2/4/8 machine vectors) and the general loops
@pytest.mark.parametrize("window", [None, 21])
def test_c_decode_with_sinks_matches_reference(head_dim, window):
    num_kv_heads, group, block_size = 2, 3, 16
    lengths = [1, 5, 16, 17, 33, 47, 70]
    k_cache, v_cache, tables, _, _ = scattered_paged_cache(lengths, num_kv_heads, head_dim, block_size, seed=1)
    torch.manual_seed(0)
    q = torch.randn(len(lengths), num_kv_heads, group, head_dim) * 3
    lens = torch.tensor(lengths, dtype=torch.int32)
    scale, sinks = head_dim ** -0.5, _sinks(num_kv_heads * group)
    got = cpu_paged_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, block_size, scale,
                                                     sliding_window=window, sinks=sinks)
    cu = torch.arange(len(lengths) + 1, dtype=torch.int32)
    args = (q.reshape(len(lengths), -1, head_dim), k_cache, v_cache, tables, cu, lens, scale, block_size)
    expected = paged_attention_reference(*args, sliding_window=window, sinks=sinks)
    torch.testing.assert_close(got.reshape(expected.shape), expected, rtol=1e-5, atol=1e-5)
    without = paged_attention_reference(*args, sliding_window=window)
    assert (expected - without).abs().max() > 0.1  # the sinks matter


@pytest.mark.parametrize("head_dim", [64, 128])
def test_c_decode_bfloat16_with_sinks_matches_reference(head_dim):
    """bfloat16 queries over a bfloat16 cache (the BF16-unit form where the CPU has one)."""
    check_c_decode_bfloat16(head_dim, sinks=_sinks(4).bfloat16())


@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (32, 5), (16, 16)])
@pytest.mark.parametrize("window", [None, 7, 33])
def test_c_prefill_with_sinks_matches_reference(head_dim, block_size, window):
    """Fresh prompts, chunks over cached contexts, one long chunk whose rows are split across threads."""
    num_kv_heads, group = 2, 3
    chunks = [(40, 0), (1, 50), (16, 16), (9, 3), (130, 45)]  # (queries, cached context)
    lengths = [q + c for q, c in chunks]
    k_cache, v_cache, tables, _, _ = scattered_paged_cache(lengths, num_kv_heads, head_dim, block_size, seed=2)
    torch.manual_seed(0)
    q = torch.randn(sum(n for n, _ in chunks), group * num_kv_heads, head_dim) * 3
    out = torch.full_like(q, 7.0)
    as_int = lambda values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
    starts = [sum(n for n, _ in chunks[:i]) for i in range(len(chunks))]
    scale, sinks = head_dim ** -0.5, _sinks(num_kv_heads * group)
    cpu_paged_attention.paged_prefill_attention(q, k_cache, v_cache, as_int(starts), as_int([n for n, _ in chunks]),
                                                as_int([c for _, c in chunks]), tables, block_size, scale, out,
                                                sliding_window=window, sinks=sinks)
    cu = torch.tensor([0] + [n for n, _ in chunks]).cumsum(0).to(torch.int32)
    expected = paged_attention_reference(q, k_cache, v_cache, tables, cu, as_int(lengths), scale, block_size,
                                         sliding_window=window, sinks=sinks)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_c_kernels_refuse_sinks_of_the_wrong_size():
    cache = torch.zeros(16, 1, 16)
    q = torch.zeros(1, 1, 2, 16)
    args = (q, cache, cache, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 16, 1.0)
    with pytest.raises(ValueError, match="one logit per query head"):
        cpu_paged_attention.paged_decode_attention(*args, sinks=torch.zeros(3))


@pytest.mark.triton
@pytest.mark.parametrize("dtype,window", [(torch.float32, None), (torch.float32, 5), (torch.float16, 32)])
def test_triton_with_sinks_matches_reference(dtype, window):
    """Decodes, a fresh prompt, chunks over cached prefixes (mixed in one step), unsplit and split-KV (the
    two modes bitwise equal)."""
    from tests.kernels.test_triton_paged_attention import make_step

    step = make_step([1, 1, 1, 40, 9, 16], [15, 33, 70, 40, 50, 48], 4, 2, 64, dtype=dtype, seed=3)
    step.q.mul_(3)
    sinks = _sinks(4)
    ref = paged_attention_reference(*step.args(), sliding_window=window, sinks=sinks)
    split = step.run_split(32, 3, sliding_window=window, sinks=sinks)
    for out in (step.run(sliding_window=window, sinks=sinks), split):
        assert not out.isnan().any(), "a read outside the sequence's slots"
        if dtype == torch.float32:
            torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
        else:
            torch.testing.assert_close(out.float(), ref.float(), atol=2e-3 * ref.abs().max().item(), rtol=1e-2)
    # three 32-key splits cover every sequence (70 keys at most): the unsplit kernel over the same chunks is
    # bitwise the split result, the sink merged last in both
    assert torch.equal(step.run(sliding_window=window, sinks=sinks, split_size=32), split)
    assert (ref - paged_attention_reference(*step.args(), sliding_window=window)).abs().max() > 0.05


def test_sdpa_attend_with_sinks_matches_reference():
    """The SDPA backend's explicit path (engine/attention/sdpa.attend), causal and masked, with GQA."""
    from batchgen.engine.attention.sdpa import attend

    gen = torch.Generator().manual_seed(2)
    num_heads, num_kv_heads, length, head_dim = 4, 2, 19, 16
    q = torch.randn(1, num_heads, length, head_dim, generator=gen) * 2
    k = torch.randn(1, num_kv_heads, length, head_dim, generator=gen)
    v = torch.randn(1, num_kv_heads, length, head_dim, generator=gen)
    sinks = _sinks(num_heads)
    got = attend(q, k, v, None, head_dim ** -0.5, None, True, is_causal=True, sinks=sinks.view(1, -1, 1, 1))
    k_cache = torch.zeros(32, num_kv_heads, head_dim)
    v_cache = torch.zeros(32, num_kv_heads, head_dim)
    k_cache[:length], v_cache[:length] = k[0].transpose(0, 1), v[0].transpose(0, 1)
    expected = paged_attention_reference(q[0].transpose(0, 1), k_cache, v_cache, torch.arange(2, dtype=torch.int32)[None],
                                         torch.tensor([0, length], dtype=torch.int32),
                                         torch.tensor([length], dtype=torch.int32), head_dim ** -0.5, 16, sinks=sinks)
    torch.testing.assert_close(got[0].transpose(0, 1), expected, rtol=1e-5, atol=1e-5)
