"""The Triton SGMV shrink/expand (LoRA on CUDA) against the torch reference, under TRITON_INTERPRET=1:
segments of one token and of many (scattered rows), ranks 8/16/32/64, an empty segment, a slot whose
adapter does not target the module (rank 0), base tokens left bit-for-bit as they were, every tile
candidate of the tuning table; and LoRALinear's Triton path equals its torch path."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel module is imported: jit reads it then

from batchgen.kernels.reference import lora_segments_ref  # noqa: E402
from batchgen.kernels.triton_lora import sgmv_expand, sgmv_shrink  # noqa: E402
from batchgen.kernels.triton_tuning import lora_candidates  # noqa: E402

pytestmark = pytest.mark.triton

IN, OUT, R_MAX = 80, 100, 64  # neither a multiple of the K or N tiles: padded tiles
RANKS = [8, 16, 64, 32, 0]  # slot 4: an adapter that does not target this module
SEGMENT_SIZES = [1, 20, 17, 0, 5]  # slot 3: an empty segment


def step(num_tokens: int = 60, seed: int = 0):
    """Weights of five slots and a step whose segments take scattered tokens; the rest are base tokens."""
    gen = torch.Generator().manual_seed(seed)
    lora_a = torch.zeros(len(RANKS), IN, R_MAX)
    lora_b = torch.zeros(len(RANKS), R_MAX, OUT)
    for slot, rank in enumerate(RANKS):  # columns past the rank stay 0, as LoRALinear.install leaves them
        lora_a[slot, :, :rank] = torch.randn(IN, rank, generator=gen) / IN ** 0.5
        lora_b[slot, :rank] = torch.randn(rank, OUT, generator=gen) / max(rank, 1) ** 0.5
    tokens = torch.randperm(num_tokens, generator=gen)[:sum(SEGMENT_SIZES)]
    starts = torch.tensor([0, *torch.tensor(SEGMENT_SIZES).cumsum(0).tolist()], dtype=torch.int32)
    x = torch.randn(num_tokens, IN, generator=gen)
    out = torch.randn(num_tokens, OUT, generator=gen)
    return x, out, lora_a, lora_b, tokens.to(torch.int32), starts, torch.arange(len(RANKS), dtype=torch.int32), \
        torch.tensor(RANKS, dtype=torch.int32)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_shrink_then_expand_equals_the_reference(dtype, tolerance):
    x, out, lora_a, lora_b, order, starts, slots, ranks = step()
    x, out, lora_a, lora_b = x.to(dtype), out.to(dtype), lora_a.to(dtype), lora_b.to(dtype)
    expected = lora_segments_ref(x, out, lora_a, lora_b, order, starts, slots, ranks)
    base_rows = torch.ones(out.shape[0], dtype=torch.bool)
    base_rows[order.long()] = False
    untouched = out[base_rows].clone()
    shrunk = sgmv_shrink(x, lora_a, order, starts, slots, ranks, max(SEGMENT_SIZES))
    assert shrunk.shape == (order.numel(), R_MAX) and shrunk.dtype == torch.float32
    for s, (rank, start) in enumerate(zip(RANKS, starts.tolist())):  # each segment's shrink on its own
        rows = order[start:start + SEGMENT_SIZES[s]].long()
        torch.testing.assert_close(shrunk[start:start + SEGMENT_SIZES[s], :rank],
                                   x[rows].float() @ lora_a[s, :, :rank].float(), atol=1e-5, rtol=1e-5)
        assert not shrunk[start:start + SEGMENT_SIZES[s], rank:].any()
    sgmv_expand(shrunk, lora_b, out, order, starts, slots, ranks, max(SEGMENT_SIZES))
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=tolerance)
    assert torch.equal(out[base_rows], untouched)  # base tokens exactly as the base layer wrote them
    rank0_rows = order[starts[4]:starts[5]].long()
    assert torch.equal(out[rank0_rows], step()[1].to(dtype)[rank0_rows])  # rank 0: nothing added


@pytest.mark.parametrize("max_segment_len", [1, 20], ids=["decode", "prefill"])
def test_every_tuning_candidate_matches_the_reference(max_segment_len):
    x, out, lora_a, lora_b, order, starts, slots, ranks = step()
    expected = lora_segments_ref(x, out, lora_a, lora_b, order, starts, slots, ranks)
    longest = max(SEGMENT_SIZES)  # the grid must cover the longest segment, whatever bucket picked the tiles
    for shrink_tiles in lora_candidates("shrink", max_segment_len, torch.float32):
        shrunk = sgmv_shrink(x, lora_a, order, starts, slots, ranks, longest, tiles=shrink_tiles)
        for expand_tiles in lora_candidates("expand", max_segment_len, torch.float32)[:2]:
            result = sgmv_expand(shrunk, lora_b, out.clone(), order, starts, slots, ranks, longest, tiles=expand_tiles)
            torch.testing.assert_close(result, expected, atol=1e-5, rtol=1e-5, msg=f"{shrink_tiles} {expand_tiles}")
    for expand_tiles in lora_candidates("expand", max_segment_len, torch.float32)[2:]:
        result = sgmv_expand(shrunk, lora_b, out.clone(), order, starts, slots, ranks, longest, tiles=expand_tiles)
        torch.testing.assert_close(result, expected, atol=1e-5, rtol=1e-5, msg=str(expand_tiles))


def test_a_step_without_segments_changes_nothing():
    x, out, lora_a, lora_b, *_ = step()
    empty = torch.zeros(0, dtype=torch.int32)
    before = out.clone()
    shrunk = sgmv_shrink(x, lora_a, empty, torch.zeros(1, dtype=torch.int32), empty, torch.zeros(5, dtype=torch.int32), 0)
    sgmv_expand(shrunk, lora_b, out, empty, torch.zeros(1, dtype=torch.int32), empty,
                torch.zeros(5, dtype=torch.int32), 0)
    assert shrunk.shape == (0, R_MAX) and torch.equal(out, before)


def test_lora_linear_triton_path_equals_its_torch_path():
    from batchgen.engine.lora.layers import LoRALinear, LoRAStepMapping, LoRAStepState

    x, _, lora_a, lora_b, order, starts, slots, ranks = step(seed=1)
    base = torch.nn.Linear(IN, OUT, bias=False)
    outputs = []
    for use_triton in (False, True):
        state = LoRAStepState(use_triton=use_triton)
        layer = LoRALinear(base, len(RANKS), R_MAX, state, torch.float32, torch.device("cpu"))
        for slot, rank in enumerate(RANKS):
            layer.install(slot, None if rank == 0 else (lora_a[slot, :, :rank], lora_b[slot, :rank]))
        bounds = starts.tolist()
        segments = [(slot, bounds[slot], bounds[slot + 1]) for slot in range(len(RANKS)) if SEGMENT_SIZES[slot]]
        # the kernels' segment tensors keep the empty segment; the torch path's list skips it
        state.mapping = LoRAStepMapping(segments, order, starts, slots, [order[a:b].long() for _, a, b in segments],
                                        max(SEGMENT_SIZES))
        with torch.no_grad():
            outputs.append(layer(x))
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-5, rtol=1e-5)
