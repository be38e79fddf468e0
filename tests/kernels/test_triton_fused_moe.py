"""The Triton fused MoE (kernels/triton_fused_moe.py) against the per-expert torch reference, under
TRITON_INTERPRET=1 on the CPU: top-1, top-2 and top-8; an expert that receives no token; uneven counts;
float32 and float16 at small shapes (bfloat16 tl.dot is wrong in the interpreter); every tile candidate
of the tuning table's three row buckets."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel module is imported: jit reads it then

import pytest
import torch

from batchgen.kernels.fused_moe import fused_moe_per_expert_ref
from batchgen.kernels.triton_fused_moe import align_by_expert, fused_moe_triton
from batchgen.kernels.triton_tuning import moe_candidates

pytestmark = pytest.mark.triton

NUM_EXPERTS = 10
EMPTY_EXPERT = 7


def problem(num_tokens: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    gate_up = (torch.randn(NUM_EXPERTS, 2 * inter, hidden, generator=gen) * 0.3).to(dtype)
    down = (torch.randn(NUM_EXPERTS, hidden, inter, generator=gen) * 0.3).to(dtype)
    # k distinct experts per token, never EMPTY_EXPERT; expert 0 in most tokens (uneven counts)
    choices = [e for e in range(NUM_EXPERTS) if e != EMPTY_EXPERT]
    ids = torch.stack([torch.tensor(choices)[torch.randperm(len(choices), generator=gen)[:top_k]]
                       for _ in range(num_tokens)])
    if top_k < len(choices):
        ids[: num_tokens * 2 // 3, 0] = torch.where(ids[: num_tokens * 2 // 3].eq(0).any(1), ids[: num_tokens * 2 // 3, 0], 0)
    weights = torch.softmax(torch.randn(num_tokens, top_k, generator=gen), dim=-1)
    return x, gate_up, down, weights, ids


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours.float() - reference.float()).abs().max() / reference.float().abs().max()).item()


def test_the_alignment_pads_each_experts_run_to_whole_blocks():
    ids = torch.tensor([[2, 0], [0, 2], [2, 1]])
    rows, block_experts = align_by_expert(ids, 4, block_m=4)
    sentinel = 6
    # expert 0: rows 1, 2; expert 1: row 5; expert 2: rows 0, 3, 4; expert 3: none
    assert rows.tolist()[:12] == [1, 2, sentinel, sentinel, 5, sentinel, sentinel, sentinel, 0, 3, 4, sentinel]
    assert block_experts.tolist()[:3] == [0, 1, 2] and set(block_experts.tolist()[3:]) == {-1}
    assert rows.numel() == 6 + 4 * 3 + 2  # T*k + E*(block_m - 1), rounded up to whole blocks


@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_the_per_expert_reference(top_k, dtype):
    x, gate_up, down, weights, ids = problem(13, top_k, 48, 40, dtype, seed=top_k)
    counts = torch.bincount(ids.flatten(), minlength=NUM_EXPERTS)
    assert counts[EMPTY_EXPERT] == 0 and len(set(counts.tolist())) > 1
    out = fused_moe_triton(x, gate_up, down, weights, ids)
    reference = fused_moe_per_expert_ref(x.float(), gate_up.float(), down.float(), weights, ids)
    assert out.dtype == dtype
    assert relative_error(out, reference) <= (1e-5 if dtype == torch.float32 else 5e-3)


@pytest.mark.parametrize("rows_per_expert", [4, 32, 100])
def test_every_tile_candidate_matches_the_reference(rows_per_expert):
    x, gate_up, down, weights, ids = problem(9, 2, 40, 24, torch.float16, seed=rows_per_expert)
    reference = fused_moe_per_expert_ref(x.float(), gate_up.float(), down.float(), weights, ids)
    seen = set()
    for tiles in moe_candidates(rows_per_expert, 40, torch.float16):
        if (tiles.block_m, tiles.block_n, tiles.block_k) in seen:
            continue
        seen.add((tiles.block_m, tiles.block_n, tiles.block_k))
        out = fused_moe_triton(x, gate_up, down, weights, ids, tiles=tiles)
        assert relative_error(out, reference) <= 5e-3, tiles


def test_biased_experts_with_the_clamped_swiglu_match_the_torch_path():
    """gpt-oss's experts: biases after each projection and the clamped SwiGLU, against fused_moe_torch's
    (itself checked against transformers' GptOssMLP in tests/engine/models/test_moe_gpt_oss_block.py)."""
    from batchgen.kernels.fused_moe import clamped_swiglu_rows, fused_moe_torch

    x, gate_up, down, weights, ids = problem(13, 4, 48, 40, torch.float32, seed=5)
    gen = torch.Generator().manual_seed(6)
    gate_up_bias, down_bias = torch.randn(NUM_EXPERTS, 80, generator=gen), torch.randn(NUM_EXPERTS, 48, generator=gen)
    x = x * 3.0  # some gate and up values past the limit

    def activation(rows):
        return clamped_swiglu_rows(rows, 1.702, 2.0)

    reference = fused_moe_torch(x, gate_up, down, weights, ids, activation, gate_up_bias, down_bias)
    out = fused_moe_triton(x, gate_up, down, weights, ids, activation=activation, gate_up_bias=gate_up_bias,
                           down_bias=down_bias)
    assert relative_error(out, reference) <= 1e-5
    plain = fused_moe_triton(x, gate_up, down, weights, ids)
    assert relative_error(plain, reference) > 1e-2  # the biases and the clamps changed the result


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_experts_equal_the_torch_path_on_the_same_codes(dtype):
    """E4M3 expert stacks with per-(expert, channel) scales (engine/quant/fp8_experts.py): the kernel widens
    the codes and scales its accumulators; the CPU path widens each expert's weights. Both against the
    per-expert reference on the dequantized weights, and close to the unquantized experts."""
    from batchgen.engine.quant.fp8_experts import Fp8ExpertStack, quantize_expert_stack
    from batchgen.kernels.fused_moe import fused_moe_torch

    x, gate_up, down, weights, ids = problem(24, 2, 64, 32, dtype, seed=5)
    (gu_codes, gu_scales), (d_codes, d_scales) = quantize_expert_stack(gate_up), quantize_expert_stack(down)
    ours = fused_moe_triton(x, gu_codes, d_codes, weights, ids, gate_up_scale=gu_scales, down_scale=d_scales)
    widened = [Fp8ExpertStack(gu_codes, gu_scales, dtype), Fp8ExpertStack(d_codes, d_scales, dtype)]
    torch_path = fused_moe_torch(x, *widened, weights, ids)
    dequantized = [torch.stack([stack[e] for e in range(NUM_EXPERTS)]) for stack in widened]
    reference = fused_moe_per_expert_ref(x, *dequantized, weights, ids)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    assert relative_error(ours, reference) < tolerance
    assert relative_error(torch_path, reference) < tolerance
    assert 1e-3 < relative_error(ours, fused_moe_per_expert_ref(x, gate_up, down, weights, ids)) < 0.05  # E4M3 rounding
