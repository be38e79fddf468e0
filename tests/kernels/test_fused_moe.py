"""The MoE router variants against hand arithmetic, and the CPU fused MoE (kernels/fused_moe.py) against
the per-expert reference loop and transformers' own experts module, with an expert that receives no
token and uneven counts."""

from __future__ import annotations

import math

import pytest
import torch

from batchgen.engine.models.layers.moe import route
from batchgen.kernels.fused_moe import fused_moe_per_expert_ref, fused_moe_torch, sort_by_expert


def test_softmax_then_top_k_with_and_without_renormalising():
    logits = torch.tensor([[0.0, math.log(2.0), math.log(3.0), math.log(4.0)]])  # softmax: 0.1, 0.2, 0.3, 0.4
    weights, ids = route(logits, 2, "softmax_topk", renormalize=False)
    assert ids.tolist() == [[3, 2]]
    assert torch.allclose(weights, torch.tensor([[0.4, 0.3]]))
    weights, _ = route(logits, 2, "softmax_topk", renormalize=True)
    assert torch.allclose(weights, torch.tensor([[4 / 7, 3 / 7]]))


def test_top_k_then_softmax_over_the_chosen():
    logits = torch.tensor([[5.0, 1.0, 4.0, -2.0]])
    weights, ids = route(logits, 2, "topk_softmax", renormalize=False)
    assert ids.tolist() == [[0, 2]]
    e = math.exp(1.0)
    assert torch.allclose(weights, torch.tensor([[e / (e + 1), 1 / (e + 1)]]))
    with pytest.raises(ValueError, match="moe_router 'sigmoid' is not one of"):
        route(logits, 2, "sigmoid", renormalize=False)


def test_the_sort_groups_rows_by_expert_in_token_order():
    ids = torch.tensor([[2, 0], [0, 2], [2, 1]])
    order, counts = sort_by_expert(ids, 4)
    assert counts.tolist() == [2, 1, 3, 0]  # expert 3: no token
    assert order.tolist() == [1, 2, 5, 0, 3, 4]


@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_path_equals_the_per_expert_loop(top_k, dtype):
    gen = torch.Generator().manual_seed(top_k)
    num_tokens, hidden, inter, num_experts = 37, 48, 40, 8
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.2).to(dtype)
    down = (torch.randn(num_experts, hidden, inter, generator=gen) * 0.2).to(dtype)
    # uneven counts, expert 5 receives nothing
    ids = torch.stack([torch.randperm(num_experts - 1, generator=gen)[:top_k] for _ in range(num_tokens)])
    ids = torch.where(ids >= 5, ids + 1, ids)
    ids[:20, 0] = 0
    weights = torch.softmax(torch.randn(num_tokens, top_k, generator=gen), dim=-1)
    ours = fused_moe_torch(x, gate_up, down, weights, ids)
    reference = fused_moe_per_expert_ref(x, gate_up, down, weights, ids)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    assert ((ours.float() - reference.float()).abs().max() / reference.float().abs().max()).item() <= tolerance


@torch.no_grad()
def test_the_fused_path_equals_transformers_experts_module():
    import transformers

    config = transformers.MixtralConfig(hidden_size=32, intermediate_size=24, num_local_experts=6, num_experts_per_tok=2)
    block = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(config).float().eval()
    torch.manual_seed(0)
    for param in block.parameters():
        param.normal_(0.0, 0.3)
    x = torch.randn(29, 32)
    expected = block(x.unsqueeze(0))[0]
    weights, ids = route(x @ block.gate.weight.t(), 2, "softmax_topk", renormalize=True)
    assert set(ids.flatten().tolist()) == set(range(6))
    ours = fused_moe_torch(x, block.experts.gate_up_proj, block.experts.down_proj, weights, ids)
    assert (ours - expected).abs().max().item() <= 1e-5
