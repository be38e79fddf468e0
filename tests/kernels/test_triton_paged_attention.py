"""The Triton paged-attention kernel against the torch reference, under TRITON_INTERPRET=1.

Cases cover pairwise (not as a product): GQA ratios 1/4/5/7, head sizes 64/80/128, context lengths
1/15/16/17/33 and past a split, block sizes 16/32, decode-only / prefill-only / mixed steps / chunks
over a cached prefix, padded rows, FP8 caches, split-KV, batch invariance. Caches are NaN outside
the slots a step may read and block tables are scattered, so an out-of-bounds read shows as NaN.
float16/float32 only: bfloat16 tl.dot is wrong in the interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from batchgen.kernels.reference import kv_store_reference, paged_attention_reference, quantize_kv_reference
from batchgen.kernels.triton_kv_store import store_kv
from batchgen.kernels.triton_paged_attention import paged_attention, workspace_shape
from batchgen.kernels.triton_tuning import AttentionTiles

pytestmark = pytest.mark.triton


@dataclass
class Step:
    q: torch.Tensor  # (T, Hq, D)
    k_cache: torch.Tensor  # (num_slots, Hkv, D)
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # (S, max_blocks) int32
    cu_query_lens: torch.Tensor  # (S+1,) int32
    seq_lens: torch.Tensor  # (S,) int32
    sm_scale: float
    block_size: int
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.cu_query_lens, self.seq_lens,
                self.sm_scale, self.block_size)

    def scales(self):
        return dict(k_scale=self.k_scale, v_scale=self.v_scale)

    def run(self, **kwargs) -> torch.Tensor:
        if "split_size" in kwargs:  # chunks of 32 keys: tiles of 32
            kwargs.setdefault("tiles", AttentionTiles(16, 32))
        return paged_attention(*self.args(), **self.scales(), **kwargs)

    def run_split(self, split_size: int, num_splits: int, **kwargs) -> torch.Tensor:
        """Split-KV: one program per chunk of split_size keys, up to num_splits of them."""
        return self.run(split_size=split_size, workspace=workspace(self.q.shape[0], *self.q.shape[1:], num_splits),
                        **kwargs)

    def reference(self) -> torch.Tensor:
        return paged_attention_reference(*self.args(), **self.scales())

    def alone(self, s: int) -> tuple[Step, slice]:
        """Sequence s as a step of its own, and its tokens' rows in this step."""
        lo, hi = self.cu_query_lens[s].item(), self.cu_query_lens[s + 1].item()
        return Step(self.q[lo:hi].clone(), self.k_cache, self.v_cache, self.block_tables[s:s + 1].clone(),
                    torch.tensor([0, hi - lo], dtype=torch.int32), self.seq_lens[s:s + 1].clone(),
                    self.sm_scale, self.block_size, self.k_scale, self.v_scale), slice(lo, hi)


def workspace(num_tokens: int, num_q_heads: int, head_size: int, num_splits: int):
    acc = torch.empty(workspace_shape(num_tokens, num_q_heads, head_size, num_splits))
    return acc, torch.empty(acc.shape[:3]), torch.empty(acc.shape[:3])


def make_step(query_lens: list[int], seq_lens: list[int], num_q_heads: int, num_kv_heads: int, head_size: int,
              *, dtype=torch.float32, cache_dtype=None, block_size: int = 16, seed: int = 0,
              pad_rows: int = 0) -> Step:
    """A random step over scattered blocks. Cache slots no sequence owns are NaN, and so are the table
    entries past each sequence's blocks (they name a NaN block). `pad_rows` appends CUDA-graph
    padding rows: one query, seq_len 1, first table entry a finite block."""
    gen = torch.Generator().manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    is_fp8 = cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    num_used = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(num_used) + 3
    max_blocks = max(num_used + [1]) + 1
    order = torch.randperm(num_blocks, generator=gen).tolist()
    nan_block, pad_block = order.pop(), order.pop()
    tables = torch.full((len(seq_lens) + pad_rows, max_blocks), nan_block, dtype=torch.int32)
    num_slots = num_blocks * block_size
    k = torch.full((num_slots, num_kv_heads, head_size), float("nan"))
    v = torch.full((num_slots, num_kv_heads, head_size), float("nan"))
    for s, (n, used) in enumerate(zip(seq_lens, num_used)):
        blocks = [order.pop() for _ in range(used)]
        tables[s, :used] = torch.tensor(blocks, dtype=torch.int32)
        pos = torch.arange(n)
        slots = torch.tensor(blocks)[pos // block_size] * block_size + pos % block_size
        k[slots] = torch.randn(n, num_kv_heads, head_size, generator=gen)
        v[slots] = torch.randn(n, num_kv_heads, head_size, generator=gen)
    pad_slots = pad_block * block_size + torch.arange(block_size)
    k[pad_slots] = torch.randn(block_size, num_kv_heads, head_size, generator=gen)
    v[pad_slots] = torch.randn(block_size, num_kv_heads, head_size, generator=gen)
    tables[len(seq_lens):, 0] = pad_block
    query_lens = list(query_lens) + [1] * pad_rows
    seq_lens = list(seq_lens) + [1] * pad_rows
    k_scale = v_scale = None
    if is_fp8:
        k_scale, v_scale = torch.tensor([0.02]), torch.tensor([0.03])
        k = quantize_kv_reference(k * 4, cache_dtype, k_scale)
        v = quantize_kv_reference(v * 4, cache_dtype, v_scale)
    else:
        k, v = k.to(cache_dtype), v.to(cache_dtype)
    cu = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu[-1]), num_q_heads, head_size, generator=gen).to(dtype)
    return Step(q, k, v, tables, cu, torch.tensor(seq_lens, dtype=torch.int32), head_size ** -0.5, block_size,
                k_scale, v_scale)


def assert_close_to_reference(step: Step, out: torch.Tensor):
    ref = step.reference()
    assert not out.isnan().any(), "NaN in the output: a read outside the sequence's slots"
    if step.q.dtype == torch.float32 and step.k_scale is None:
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    else:  # float16 dots (probabilities rounded to float16): an error relative to the values' scale
        scale = ref.abs().max().item()
        torch.testing.assert_close(out.float(), ref.float(), atol=1e-3 * scale, rtol=1e-2)


# (name, query_lens, seq_lens, Hq, Hkv, head_size, dtype, block_size)
CASES = [
    # Decodes at context lengths 1, 15, 16, 17, 33; GQA 4, D 128.
    ("decode", [1] * 5, [1, 15, 16, 17, 33], 8, 2, 128, torch.float16, 16),
    # Fresh prompts (query = context) at 15 and 17 tokens; no GQA, D 64, block 32.
    ("prefill", [15, 17], [15, 17], 2, 2, 64, torch.float32, 32),
    # Decodes, a fresh prompt and a chunk over a cached prefix in one step; GQA 5, D 80 (padded tile).
    ("mixed", [1, 1, 17, 9], [16, 33, 17, 33], 5, 1, 80, torch.float16, 16),
    # Chunks over cached prefixes of 17 and 16 tokens, and one of 1; GQA 7 (28:4 as in Qwen2.5-7B), D 64.
    ("chunks", [16, 5, 3], [33, 21, 4], 7, 1, 64, torch.float32, 16),
]


@pytest.mark.parametrize("name,query_lens,seq_lens,num_q_heads,num_kv_heads,head_size,dtype,block_size",
                         CASES, ids=[c[0] for c in CASES])
def test_matches_reference(name, query_lens, seq_lens, num_q_heads, num_kv_heads, head_size, dtype,
                           block_size):
    step = make_step(query_lens, seq_lens, num_q_heads, num_kv_heads, head_size, dtype=dtype,
                     block_size=block_size)
    assert_close_to_reference(step, step.run())


def test_fp8_e4m3_cache_matches_reference_over_dequantized_cache():
    step = make_step([1, 1, 6], [17, 1, 22], 8, 2, 128, dtype=torch.float16, cache_dtype=torch.float8_e4m3fn)
    assert_close_to_reference(step, step.run())


def test_fp8_e5m2_cache_matches_reference_over_dequantized_cache():
    step = make_step([1, 9], [33, 16], 7, 1, 80, dtype=torch.float32, cache_dtype=torch.float8_e5m2)
    out = step.run()
    assert_close_to_reference(step, out)
    # The scales are applied: without them the output would be ~30x off.
    unscaled = Step(*step.args(), k_scale=torch.tensor([1.0]), v_scale=torch.tensor([1.0]))
    assert (unscaled.run() - out).abs().max() > 1.0


def test_one_step_store_then_attend_with_fp8_cache():
    """A step as the model runner runs it: this step's keys and values stored (quantized) at their
    slots, then attention reads prefix and new tokens alike from the cache."""
    step = make_step([1, 6], [18, 22], 4, 1, 64, dtype=torch.float16, cache_dtype=torch.float8_e4m3fn, seed=7)
    gen = torch.Generator().manual_seed(8)
    new_k = torch.randn(7, 1, 64, generator=gen).half() * 4
    new_v = torch.randn(7, 1, 64, generator=gen).half() * 4
    slots = []
    for s, (q_len, seq_len) in enumerate([(1, 18), (6, 22)]):
        pos = torch.arange(seq_len - q_len, seq_len)
        blocks = step.block_tables[s].long()[pos // step.block_size]
        slots.append(blocks * step.block_size + pos % step.block_size)
    slot_mapping = torch.cat(slots)  # (T,) int64
    expected_k, _ = kv_store_reference(new_k, new_v, step.k_cache, step.v_cache, slot_mapping,
                                       step.k_scale, step.v_scale)
    store_kv(new_k, new_v, step.k_cache, step.v_cache, slot_mapping, step.k_scale, step.v_scale)
    # The new keys landed (test_triton_kv_store checks the values; the interpreter's FP8 cast
    # mis-rounds a few of them).
    is_same = step.k_cache.view(torch.uint8) == expected_k.view(torch.uint8)  # (num_slots, Hkv, D)
    is_written = torch.zeros(is_same.shape[0], dtype=torch.bool)
    is_written[slot_mapping] = True
    assert is_same[~is_written].all()
    assert is_same[is_written].float().mean() > 0.95
    assert_close_to_reference(step, step.run())


def test_padded_rows_write_only_their_own_rows():
    """Convention: a sequence may have zero query tokens (nothing computed for it); CUDA-graph
    padding rows have one query token, seq_len 1 and a valid first block (the KV store skips their
    slot -1): their output is the value at that slot, finite, and real rows are unaffected."""
    step = make_step([1, 0, 4], [5, 12, 20], 4, 1, 64, dtype=torch.float32, pad_rows=2)
    out = step.run(out=torch.full_like(step.q, 7.0))
    assert_close_to_reference(step, out)
    pad_slot = step.block_tables[-1, 0].long() * step.block_size
    expected = step.v_cache[pad_slot].repeat_interleave(4, dim=0)  # (Hq, D): softmax over one key
    torch.testing.assert_close(out[-1], expected)
    torch.testing.assert_close(out[-2], expected)


def test_split_kv_decode_matches_reference_and_is_bitwise_the_unsplit_result():
    # Chunks of 32 keys: 1 and 17 tokens fit one, 33 takes two, 100 four, past 2 splits (the last split
    # takes the rest). The unsplit kernel merges the same chunks in the same order: bitwise the same
    # result whenever the splits cover the sequence.
    step = make_step([1] * 4, [1, 17, 33, 100], 8, 2, 64, dtype=torch.float32)
    unsplit = step.run(split_size=32)
    assert_close_to_reference(step, unsplit)
    two = step.run_split(32, 2)
    assert_close_to_reference(step, two)
    assert torch.equal(two[:3], unsplit[:3])
    assert torch.equal(step.run_split(32, 4), unsplit)  # four splits cover 100 keys
    # The chunking is part of the arithmetic: another chunk size gives another (close) sum.
    assert not torch.equal(step.run(split_size=64)[2:], unsplit[2:])


def test_split_kv_with_prefill_chunks_and_reused_workspace():
    step = make_step([1, 7, 1], [40, 39, 15], 5, 1, 80, dtype=torch.float16)
    scratch = workspace(step.q.shape[0], 5, 80, 3)
    out = torch.empty_like(step.q)
    result = step.run(split_size=16 * 2, workspace=scratch, out=out)
    assert result.data_ptr() == out.data_ptr()
    assert_close_to_reference(step, out)
    assert torch.equal(out, step.run(split_size=32))  # prefill rows too: the unsplit result


@pytest.mark.parametrize("num_splits", [None, 2], ids=["unsplit", "split"])
def test_batch_invariance_alone_vs_in_batch_bitwise(num_splits):
    """A sequence's rows are bitwise the same alone and among other sequences (decodes and chunks)."""
    step = make_step([1, 9, 1, 5], [34, 20, 7, 5], 4, 1, 64, dtype=torch.float16, seed=3)

    def run(s: Step) -> torch.Tensor:
        return s.run_split(32, num_splits) if num_splits else s.run(split_size=32)

    batch = run(step)
    for s in range(4):
        alone, rows = step.alone(s)
        assert torch.equal(run(alone), batch[rows]), f"sequence {s} differs alone"


def test_decode_tokens_equal_their_rows_in_a_prefill_chunk():
    """A token gives the same bits attended as a decode and inside a prefill chunk, so a recomputed
    preempted sequence matches. Chunk index 28 sits in a query tile whose later rows reach into the
    second key tile: that tile is masked for it, and must be a bitwise no-op."""
    step = make_step([34], [36], 4, 1, 64, dtype=torch.float16, seed=5)  # positions 2..35 over a prefix of 2
    chunk = step.run()
    for index in (28, 33):
        seq_len = torch.tensor([2 + index + 1], dtype=torch.int32)
        decode = Step(step.q[index:index + 1].clone(), step.k_cache, step.v_cache, step.block_tables,
                      torch.tensor([0, 1], dtype=torch.int32), seq_len, step.sm_scale, step.block_size)
        assert torch.equal(decode.run()[0], chunk[index]), f"chunk index {index}"


def test_empty_step_returns_empty():
    step = make_step([1], [3], 2, 1, 64)
    empty = Step(step.q[:0], step.k_cache, step.v_cache, step.block_tables[:0],
                 torch.zeros(1, dtype=torch.int32), step.seq_lens[:0], 0.1, 16)
    assert empty.run().shape == (0, 2, 64)


def test_wrapper_rejects_bad_inputs():
    step = make_step([1], [3], 4, 2, 64)
    names = ["q", "k_cache", "v_cache", "block_tables", "cu_query_lens", "seq_lens", "sm_scale", "block_size"]

    def call(replace=None, **kwargs):
        args = dict(zip(names, step.args()), **(replace or {}))
        return paged_attention(*args.values(), **kwargs)

    fp8 = step.k_cache.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="multiple of 16"):
        call(dict(block_size=24))
    with pytest.raises(ValueError, match="int32"):
        call(dict(seq_lens=step.seq_lens.long()))
    with pytest.raises(ValueError, match="cu_query_lens"):
        call(dict(cu_query_lens=torch.zeros(3, dtype=torch.int32)))
    with pytest.raises(ValueError, match="dtype"):
        call(dict(k_cache=step.k_cache.half(), v_cache=step.v_cache.half()))
    with pytest.raises(ValueError, match="dtypes differ"):
        call(dict(k_cache=step.k_cache.half()))
    with pytest.raises(ValueError, match="k_scale"):
        call(dict(k_cache=fp8, v_cache=fp8), v_scale=torch.tensor([1.0]))
    with pytest.raises(ValueError, match="multiple of tile_n"):
        call(split_size=48, tiles=AttentionTiles(16, 32))
    with pytest.raises(ValueError, match="workspace must be"):
        call(workspace=workspace(2, 4, 64, 2))  # sized for 2 tokens, the step has 1
    with pytest.raises(ValueError, match="query heads"):
        call(dict(q=torch.randn(1, 3, 64)))
    with pytest.raises(ValueError, match="head_size"):
        call(dict(q=torch.randn(1, 64, 4).transpose(1, 2)))
