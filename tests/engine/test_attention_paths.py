"""Attention paths: decode staging == paged gather, padded prefill groups, fresh prompts in place, oneDNN linears."""

from __future__ import annotations

import random

import pytest
import torch

from batchgen.engine import SamplingParams
from batchgen.engine.attention import TorchAttention, build_attention_metadata
from batchgen.engine.decode_staging import DecodeRows, StagingPool
from batchgen.engine.sequence import Sequence


def _seq(num_tokens: int, block_ids: list[int], index: int) -> Sequence:
    seq = Sequence(str(index), 0, list(range(num_tokens)), SamplingParams(max_tokens=4), 0.0, 4096)
    seq.block_ids = block_ids
    seq.num_computed_tokens = num_tokens - 1
    return seq


def test_staged_and_paged_decodes_match_gather_across_joins_and_departures():
    torch.manual_seed(0)
    block_size, num_heads, num_kv_heads, head_dim = 4, 6, 2, 8
    num_slots = 64 * block_size
    k_cache = torch.randn(num_slots, num_kv_heads, head_dim)
    v_cache = torch.randn(num_slots, num_kv_heads, head_dim)
    backend = TorchAttention(num_heads, num_kv_heads, head_dim)
    rows = DecodeRows(block_size, num_kv_heads, max_tokens=10_000)
    pool = StagingPool(1, num_kv_heads, head_dim, torch.float32, torch.device("cpu"))
    free_blocks = list(range(64))
    random.Random(0).shuffle(free_blocks)
    seqs = [_seq(n, [free_blocks.pop() for _ in range(6)], i) for i, n in enumerate([3, 9, 14, 5, 1, 17])]
    # Steps with departures (seq 1 leaves, then seq 3) and a late join (seq 5).
    for active in ([0, 1, 2, 3, 4], [0, 2, 3, 4], [0, 2, 4, 5], [5, 2]):
        decodes = [seqs[i] for i in active]
        order, step = rows.plan(decodes, torch.device("cpu"))
        pool.resize(*step.capacity)
        meta = build_attention_metadata([1] * len(order), [s.num_computed_tokens for s in order],
                                        [s.block_ids for s in order], len(order), block_size, torch.device("cpu"))
        q = torch.randn(len(order), num_heads, head_dim)
        k = torch.randn(len(order), num_kv_heads, head_dim)
        v = torch.randn(len(order), num_kv_heads, head_dim)
        expected = backend.forward(q, k, v, (k_cache.clone(), v_cache.clone()), meta)
        staged_meta = build_attention_metadata([1] * len(order), [s.num_computed_tokens for s in order],
                                               [s.block_ids for s in order], len(order), block_size,
                                               torch.device("cpu"), staging=step)
        assert staged_meta.groups == []
        paged_meta = build_attention_metadata([1] * len(order), [s.num_computed_tokens for s in order],
                                              [s.block_ids for s in order], len(order), block_size,
                                              torch.device("cpu"), is_paged=True)
        assert paged_meta.groups == [] and paged_meta.paged_decode is not None
        paged = backend.forward(q, k, v, (k_cache.clone(), v_cache.clone()), paged_meta)  # the C kernel
        staged = backend.forward(q, k, v, (k_cache, v_cache, pool.layers[0]), staged_meta)  # SDPA on dense rows
        torch.testing.assert_close(staged, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(paged, expected, rtol=1e-5, atol=1e-5)
        assert [id(s) for s in order] == [id(s) for s in rows.row_seqs]
        for s in order:
            s.token_ids.append(0)
            s.num_computed_tokens += 1


def test_row_ranges_cut_where_padding_would_exceed_the_waste_limit():
    from batchgen.engine.decode_staging import row_ranges

    # Length-ordered rows: a long head, then short rows; the short ones must not pad to 2000.
    lengths = [2000, 1990, 300, 290, 280, 40, 35]
    ranges = row_ranges(lengths)
    assert ranges[0] == (0, 2) and ranges[-1][1] == len(lengths)
    assert all(lo < hi for lo, hi in ranges) and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    for lo, hi in ranges:  # every range within the waste rule (a single row always is)
        part = lengths[lo:hi]
        assert hi - lo == 1 or len(part) * max(part) <= 1.1 * sum(part) + 512
    assert row_ranges([100, 101, 99, 100]) == [(0, 4)]  # similar rows stay one batch


def test_staged_decode_in_several_row_ranges_matches_gather():
    """Rows of very different lengths are attended in separate ranges; same result as one gather."""
    torch.manual_seed(0)
    block_size, num_heads, num_kv_heads, head_dim = 4, 6, 2, 8
    k_cache = torch.randn(64 * block_size, num_kv_heads, head_dim)
    v_cache = torch.randn(64 * block_size, num_kv_heads, head_dim)
    backend = TorchAttention(num_heads, num_kv_heads, head_dim)
    rows = DecodeRows(block_size, num_kv_heads, max_tokens=10_000)
    rows.range_max_waste, rows.range_slack = 1.0, 0  # cut wherever rows differ in length
    pool = StagingPool(1, num_kv_heads, head_dim, torch.float32, torch.device("cpu"))
    seqs = [_seq(n, list(range(8 * i, 8 * i + 8)), i) for i, n in enumerate([30, 2, 17, 9])]
    order, step = rows.plan(seqs, torch.device("cpu"))
    pool.resize(*step.capacity)
    assert len(step.ranges) > 1
    q = torch.randn(len(order), num_heads, head_dim)
    k = torch.randn(len(order), num_kv_heads, head_dim)
    v = torch.randn(len(order), num_kv_heads, head_dim)
    args = ([1] * len(order), [s.num_computed_tokens for s in order], [s.block_ids for s in order],
            len(order), block_size, torch.device("cpu"))
    expected = backend.forward(q, k, v, (k_cache.clone(), v_cache.clone()), build_attention_metadata(*args))
    staged = backend.forward(q, k, v, (k_cache, v_cache, pool.layers[0]), build_attention_metadata(*args, staging=step))
    torch.testing.assert_close(staged, expected, rtol=1e-5, atol=1e-5)


def test_engine_outputs_identical_with_paged_staged_and_gathered_decodes(llm, monkeypatch):
    """Mixed lengths and max_tokens make rows leave and join mid-run; a tight memory cap makes
    staging switch off mid-run (rows cross 64 tokens) and the gather path take over."""
    from batchgen.engine.llm_engine import LLMEngine
    from batchgen.kernels import cpu_paged_attention

    rng = random.Random(1)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(5, 60))] for _ in range(10)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(2, 12), ignore_eos=True) for _ in prompts]
    prompts[0] = prompts[0][:1] * 60  # this one grows past 64 tokens while others still decode
    params[0] = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    gather_engine = LLMEngine(llm.engine.config, weights_from=llm.engine)
    gather_engine.runner.is_paged, gather_engine.runner.decode_rows = False, None  # SDPA, decodes gathered

    def run(engine):
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(str(i), p, sp)
        outs = {}
        while engine.has_unfinished():
            for o in engine.step():
                outs[o.request_id] = o.outputs[0].token_ids
        return [outs[str(i)] for i in range(len(prompts))]

    paged_engine = LLMEngine(llm.engine.config, weights_from=llm.engine)
    assert paged_engine.runner.is_paged  # the C kernels, in place in the paged cache
    monkeypatch.setattr(cpu_paged_attention, "is_available", lambda: False)  # as without a compiler
    staged_engine = LLMEngine(llm.engine.config, weights_from=llm.engine)
    capped_engine = LLMEngine(llm.engine.config, weights_from=llm.engine)
    assert not staged_engine.runner.is_paged
    capped_engine.runner.decode_rows.max_tokens = 16 * 64  # 16 rows of at most 64 tokens
    expected = run(gather_engine)
    assert run(paged_engine) == expected
    assert run(staged_engine) == expected
    assert run(capped_engine) == expected
    assert capped_engine.runner.decode_rows.num_resets > 0  # it did fall back to the gather path


def test_prefill_groups_split_when_one_long_chunk_would_pad_the_rest():
    from batchgen.engine.attention import _split_by_padding

    short, long_ = [20] * 8, [2000]
    query_lens = short + long_
    ranges = _split_by_padding(query_lens, query_lens, 0, len(query_lens))
    assert ranges == [(0, 8), (8, 9)]
    # Similar lengths stay together.
    similar = [100, 110, 120, 130]
    assert _split_by_padding(similar, similar, 0, 4) == [(0, 4)]


def _small_attention(num_heads: int, num_kv_heads: int = 2, head_dim: int = 8, block_size: int = 4):
    """A torch backend and a 64-block zeroed paged cache for kernel-level tests."""
    torch.manual_seed(0)
    k_cache = torch.zeros(64 * block_size, num_kv_heads, head_dim)
    return TorchAttention(num_heads, num_kv_heads, head_dim), k_cache, torch.zeros_like(k_cache)


def test_padded_groups_give_the_same_attention_as_one_group():
    block_size, num_heads, num_kv_heads, head_dim = 4, 4, 2, 8
    backend, k_cache, v_cache = _small_attention(num_heads)
    query_lens, context_lens = [3, 3, 200], [1, 5, 2]  # all continue a context: all gathered
    tables = [[0, 1, 2], [3, 4, 5], list(range(6, 57))]
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, num_heads, head_dim)
    k = torch.randn(num_tokens, num_kv_heads, head_dim)
    v = torch.randn(num_tokens, num_kv_heads, head_dim)
    meta = build_attention_metadata(query_lens, context_lens, tables, 0, block_size, torch.device("cpu"))
    assert len(meta.groups) == 2
    split = backend.forward(q, k, v, (k_cache, v_cache), meta)
    # Reference: each sequence alone (a group of one cannot pad).
    start = 0
    for i, n in enumerate(query_lens):
        alone = build_attention_metadata([n], [context_lens[i]], [tables[i]], 0, block_size, torch.device("cpu"))
        ref = backend.forward(q[start:start + n], k[start:start + n], v[start:start + n], (k_cache, v_cache), alone)
        torch.testing.assert_close(split[start:start + n], ref)
        start += n


def test_packed_linear_matches_torch_linear_and_survives_deepcopy():
    import copy

    from batchgen.engine.models.cpu_linear import PackedLinear, can_pack

    assert can_pack(torch.device("cpu"), torch.float32)  # CI's torch build has oneDNN
    torch.manual_seed(0)
    plain = torch.nn.Linear(48, 80)
    packed = PackedLinear(plain)
    x = torch.randn(37, 48)
    torch.testing.assert_close(packed(x), plain(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed(x[:5]), packed(x)[:5], rtol=0, atol=0)  # rows independent of batch
    twin = copy.deepcopy(packed)
    torch.testing.assert_close(twin(x), packed(x), rtol=0, atol=0)
    torch.testing.assert_close(packed.weight, plain.weight, rtol=0, atol=0)


def test_gate_up_with_silu_mul_epilogues_matches_hf_mlp_activation(llm):
    import copy

    from transformers.activations import ACT2FN

    from batchgen.engine.models.cpu_linear import PackedSiluMulLinear, can_fuse_silu_mul

    assert can_fuse_silu_mul()  # CI's torch build has oneDNN's swish and binary-mul post-ops
    assert isinstance(llm.engine.runner.model.layers[0].mlp.gate_up_proj, PackedSiluMulLinear)
    torch.manual_seed(0)
    plain = torch.nn.Linear(48, 2 * 40, bias=False)
    fused = PackedSiluMulLinear(plain)
    x = torch.randn(37, 48)
    gate, up = plain(x).chunk(2, dim=-1)
    torch.testing.assert_close(fused(x), ACT2FN["silu"](gate) * up, rtol=1e-5, atol=1e-5)  # LlamaMLP's
    torch.testing.assert_close(fused(x[:5]), fused(x)[:5], rtol=0, atol=0)  # rows independent of batch
    torch.testing.assert_close(copy.deepcopy(fused)(x), fused(x), rtol=0, atol=0)
    torch.testing.assert_close(fused.weight, plain.weight, rtol=0, atol=0)


def test_tied_lm_head_runs_through_onednn_on_the_embedding_itself(llm):
    from batchgen.engine.models.cpu_linear import OneDNNLinear

    model = llm.engine.runner.model
    assert isinstance(model.lm_head, OneDNNLinear)
    assert model.lm_head.weight is model.embed_tokens.weight  # still tied: no second copy
    x = torch.randn(9, model.cfg.hidden_size)
    expected = torch.nn.functional.linear(x, model.embed_tokens.weight)
    torch.testing.assert_close(model.lm_head(x), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model.lm_head(x[:2]), model.lm_head(x)[:2], rtol=0, atol=0)


def _naive_attention(q, k, v, num_context: int):
    """float64 reference for one sequence: q (Q, H, D) attends k, v (C + Q, Hkv, D) causally."""
    num_q, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * head_dim ** -0.5
    allowed = torch.arange(k.shape[0])[None, :] <= (num_context + torch.arange(num_q))[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).float()


def test_fresh_prompts_attended_in_place_and_chunks_with_context_match_a_naive_reference():
    block_size, num_heads, num_kv_heads, head_dim = 4, 6, 2, 8
    backend, k_cache, v_cache = _small_attention(num_heads)
    for context_lens in ([0, 0, 0], [0, 3, 0]):
        query_lens = [5, 9, 7]
        tables = [list(range(0, 4)), list(range(4, 8)), list(range(8, 12))]
        num_tokens = sum(query_lens)
        q = torch.randn(num_tokens, num_heads, head_dim)
        k = torch.randn(num_tokens, num_kv_heads, head_dim)
        v = torch.randn(num_tokens, num_kv_heads, head_dim)
        k_cache.normal_()
        v_cache.normal_()
        meta = build_attention_metadata(query_lens, context_lens, tables, 0, block_size, torch.device("cpu"))
        # Fresh prompts are attended in place; only the chunk with cached context is gathered.
        assert [n for _, n in meta.fresh] == [n for n, c in zip(query_lens, context_lens) if c == 0]
        assert [g.num_tokens for g in meta.groups] == [n for n, c in zip(query_lens, context_lens) if c > 0]
        out = backend.forward(q, k, v, (k_cache, v_cache), meta)
        start = 0
        for n, c, table in zip(query_lens, context_lens, tables):
            slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(c + n)])
            ref = _naive_attention(q[start:start + n], k_cache[slots], v_cache[slots], c)
            torch.testing.assert_close(out[start:start + n], ref, rtol=1e-4, atol=1e-5)
            start += n
