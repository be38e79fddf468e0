"""Attention backends: the C kernels (cpu) and SDPA's paths (staged decodes, padded groups, fresh
prompts in place) give the same attention, and the same engine outputs."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from batchgen.engine import SamplingParams
from batchgen.engine.attention.cpu import CpuAttention
from batchgen.engine.attention.decode_staging import DecodeRows, StagingPool, row_ranges
from batchgen.engine.attention.kv_cache import LayerKVCache
from batchgen.engine.attention.sdpa import SdpaAttention, SdpaAttentionMetadata, split_by_padding
from batchgen.engine.core.llm_engine import LLMEngine
from batchgen.engine.core.sequence import Sequence

CPU = torch.device("cpu")


def _seq(num_tokens: int, block_ids: list[int], index: int) -> Sequence:
    seq = Sequence(str(index), 0, list(range(num_tokens)), SamplingParams(max_tokens=4), 0.0, 4096)
    seq.block_ids = block_ids
    seq.num_computed_tokens = num_tokens - 1
    return seq


def _builder(backend, k_cache: torch.Tensor, block_size: int, num_layers: int = 1):
    return backend.make_metadata_builder(num_layers, k_cache.shape[0], block_size, torch.float32, CPU)


def test_staged_and_paged_decodes_match_gather_across_joins_and_departures():
    torch.manual_seed(0)
    block_size, num_heads, num_kv_heads, head_dim = 4, 6, 2, 16
    num_slots = 1024 * block_size  # room for staging's 16-row x 64-token minimum
    k_cache = torch.randn(num_slots, num_kv_heads, head_dim)
    v_cache = torch.randn(num_slots, num_kv_heads, head_dim)
    sdpa, cpu = SdpaAttention(num_heads, num_kv_heads, head_dim), CpuAttention(num_heads, num_kv_heads, head_dim)
    staging_builder, gather_builder = _builder(sdpa, k_cache, block_size), _builder(sdpa, k_cache, block_size)
    paged_builder = _builder(cpu, k_cache, block_size)
    free_blocks = list(range(64))
    random.Random(0).shuffle(free_blocks)
    seqs = [_seq(n, [free_blocks.pop() for _ in range(6)], i) for i, n in enumerate([3, 9, 14, 5, 1, 17])]
    # Steps with departures (seq 1 leaves, then seq 3) and a late join (seq 5).
    for active in ([0, 1, 2, 3, 4], [0, 2, 3, 4], [0, 2, 4, 5], [5, 2]):
        order = staging_builder.reorder_decodes([seqs[i] for i in active], 0)
        args = ([1] * len(order), [s.num_computed_tokens for s in order], [s.block_ids for s in order], len(order))
        staged_meta = staging_builder.build(*args)
        gathered_meta = gather_builder.build(*args)  # no reorder_decodes: nothing staged
        paged_meta = paged_builder.build(*args)
        assert staged_meta.staging is not None and staged_meta.groups == []
        assert gathered_meta.staging is None and len(gathered_meta.groups) == 1
        assert paged_meta.decode is not None and paged_meta.prefill is None
        q = torch.randn(len(order), num_heads, head_dim)
        k = torch.randn(len(order), num_kv_heads, head_dim)
        v = torch.randn(len(order), num_kv_heads, head_dim)
        expected = sdpa.forward(0, q, k, v, LayerKVCache(k_cache.clone(), v_cache.clone()), gathered_meta)
        paged = cpu.forward(0, q, k, v, LayerKVCache(k_cache.clone(), v_cache.clone()), paged_meta)  # the C kernel
        staged = sdpa.forward(0, q, k, v, LayerKVCache(k_cache, v_cache), staged_meta)  # SDPA on dense rows
        torch.testing.assert_close(staged, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(paged, expected, rtol=1e-5, atol=1e-5)
        for s in order:
            s.token_ids.append(0)
            s.num_computed_tokens += 1


def test_row_ranges_cut_where_padding_would_exceed_the_waste_limit():
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
    backend = SdpaAttention(num_heads, num_kv_heads, head_dim)
    rows = DecodeRows(block_size, num_kv_heads, max_tokens=10_000, range_max_waste=1.0, range_slack=0)
    pool = StagingPool(1, num_kv_heads, head_dim, torch.float32, CPU)
    seqs = [_seq(n, list(range(8 * i, 8 * i + 8)), i) for i, n in enumerate([30, 2, 17, 9])]
    order, step = rows.plan(seqs, CPU)  # cut wherever rows differ in length
    pool.resize(*step.capacity)
    assert len(step.ranges) > 1
    q = torch.randn(len(order), num_heads, head_dim)
    k = torch.randn(len(order), num_kv_heads, head_dim)
    v = torch.randn(len(order), num_kv_heads, head_dim)
    gathered = _builder(backend, k_cache, block_size).build(
        [1] * len(order), [s.num_computed_tokens for s in order], [s.block_ids for s in order], len(order))
    staged = SdpaAttentionMetadata(gathered.slot_mapping, len(order), staging=step, staging_buffers=pool.layers)
    expected = backend.forward(0, q, k, v, LayerKVCache(k_cache.clone(), v_cache.clone()), gathered)
    torch.testing.assert_close(backend.forward(0, q, k, v, LayerKVCache(k_cache, v_cache), staged), expected, rtol=1e-5, atol=1e-5)


@pytest.fixture
def decode_rows_calls(monkeypatch) -> Counter:
    """Counts DecodeRows.plan (a step staged) and DecodeRows.reset (staging dropped) calls."""
    calls: Counter = Counter()
    for name in ("plan", "reset"):
        original = getattr(DecodeRows, name)

        def spy(self, *args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(DecodeRows, name, spy)
    return calls


def test_engine_outputs_identical_with_paged_staged_and_gathered_decodes(llm, sdpa_llm, decode_rows_calls):
    """Mixed lengths and max_tokens make rows leave and join mid-run. SDPA engines: staged (roomy
    pool), gathered (a pool smaller than staging's 16-row x 64-token minimum), and staged until
    rows cross 64 tokens (a 1024-slot pool caps staging there), then gathered."""
    rng = random.Random(1)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(5, 60))] for _ in range(10)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(2, 12), ignore_eos=True) for _ in prompts]
    prompts[0] = prompts[0][:1] * 60  # this one grows past 64 tokens while others still decode
    params[0] = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def run(engine) -> list[list[int]]:
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(str(i), p, sp)
        outs = {}
        while engine.has_unfinished():
            for o in engine.step():
                outs[o.request_id] = o.outputs[0].token_ids
        return [outs[str(i)] for i in range(len(prompts))]

    def sdpa_engine(**changes) -> LLMEngine:
        return LLMEngine(sdpa_llm.engine.config.replace(**changes), weights_from=sdpa_llm.engine)

    paged_engine = LLMEngine(llm.engine.config, weights_from=llm.engine)
    assert paged_engine.stats["kernels"]["attention_backend"] == "cpu"
    assert sdpa_llm.engine.stats["kernels"]["attention_backend"] == "sdpa"
    gathered = run(sdpa_engine(num_kv_blocks=60, max_model_len=960))
    assert decode_rows_calls == Counter()  # nothing fit in staging
    assert run(paged_engine) == gathered
    assert run(sdpa_engine()) == gathered
    assert decode_rows_calls["plan"] > 0 and decode_rows_calls["reset"] == 0
    decode_rows_calls.clear()
    assert run(sdpa_engine(num_kv_blocks=64, max_model_len=1024)) == gathered
    assert decode_rows_calls["plan"] > 0 and decode_rows_calls["reset"] > 0  # it did fall back to gathering


def test_prefill_groups_split_when_one_long_chunk_would_pad_the_rest():
    short, long_ = [20] * 8, [2000]
    query_lens = short + long_
    ranges = split_by_padding(query_lens, query_lens, 0, len(query_lens))
    assert ranges == [(0, 8), (8, 9)]
    # Similar lengths stay together.
    similar = [100, 110, 120, 130]
    assert split_by_padding(similar, similar, 0, 4) == [(0, 4)]


def _small_cache(num_kv_heads: int = 2, head_dim: int = 16, block_size: int = 4):
    """A 64-block zeroed paged cache for kernel-level tests."""
    torch.manual_seed(0)
    k_cache = torch.zeros(64 * block_size, num_kv_heads, head_dim)
    return k_cache, torch.zeros_like(k_cache)


def test_padded_groups_give_the_same_attention_as_one_group():
    block_size, num_heads, num_kv_heads, head_dim = 4, 4, 2, 16
    backend = SdpaAttention(num_heads, num_kv_heads, head_dim)
    k_cache, v_cache = _small_cache(num_kv_heads, head_dim, block_size)
    builder = _builder(backend, k_cache, block_size)
    query_lens, context_lens = [3, 3, 200], [1, 5, 2]  # all continue a context: all gathered
    tables = [[0, 1, 2], [3, 4, 5], list(range(6, 57))]
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, num_heads, head_dim)
    k = torch.randn(num_tokens, num_kv_heads, head_dim)
    v = torch.randn(num_tokens, num_kv_heads, head_dim)
    meta = builder.build(query_lens, context_lens, tables, 0)
    assert len(meta.groups) == 2
    split = backend.forward(0, q, k, v, LayerKVCache(k_cache, v_cache), meta)
    # Reference: each sequence alone (a group of one cannot pad).
    start = 0
    for i, n in enumerate(query_lens):
        alone = builder.build([n], [context_lens[i]], [tables[i]], 0)
        ref = backend.forward(0, q[start:start + n], k[start:start + n], v[start:start + n], LayerKVCache(k_cache, v_cache), alone)
        torch.testing.assert_close(split[start:start + n], ref)
        start += n


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


@pytest.mark.parametrize("backend_cls", [SdpaAttention, CpuAttention])
def test_decodes_fresh_prompts_and_chunks_with_context_match_a_naive_reference(backend_cls):
    block_size, num_heads, num_kv_heads, head_dim = 4, 6, 2, 16
    backend = backend_cls(num_heads, num_kv_heads, head_dim)
    k_cache, v_cache = _small_cache(num_kv_heads, head_dim, block_size)
    builder = _builder(backend, k_cache, block_size)
    # One decode (10 tokens cached), then prefills; the second one continues 3 cached tokens.
    for context_lens in ([10, 0, 0, 0], [10, 0, 3, 0]):
        query_lens = [1, 5, 9, 7]
        tables = [list(range(12, 15)), list(range(0, 4)), list(range(4, 8)), list(range(8, 12))]
        num_tokens = sum(query_lens)
        q = torch.randn(num_tokens, num_heads, head_dim)
        k = torch.randn(num_tokens, num_kv_heads, head_dim)
        v = torch.randn(num_tokens, num_kv_heads, head_dim)
        k_cache.normal_()
        v_cache.normal_()
        meta = builder.build(query_lens, context_lens, tables, 1)
        if backend_cls is SdpaAttention:
            # Fresh prompts are attended in place; the decode and the chunk with cached context gather.
            assert [n for _, n in meta.fresh] == [n for n, c in zip(query_lens[1:], context_lens[1:]) if c == 0]
            assert [g.num_tokens for g in meta.groups] == [n for n, c in zip(query_lens, context_lens) if c > 0]
        out = backend.forward(0, q, k, v, LayerKVCache(k_cache, v_cache), meta)
        start = 0
        for n, c, table in zip(query_lens, context_lens, tables):
            slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(c + n)])
            ref = _naive_attention(q[start:start + n], k_cache[slots], v_cache[slots], c)
            torch.testing.assert_close(out[start:start + n], ref, rtol=1e-4, atol=1e-5)
            start += n
