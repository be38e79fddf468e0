"""oneDNN linear layers on the CPU (engine/models/cpu_linear.py): packed, with SiLU * up epilogues,
and the tied lm_head on the embedding's own weight."""

from __future__ import annotations

import copy

import torch

from batchgen.engine.models.cpu_linear import (
    OneDNNLinear,
    PackedLinear,
    PackedSiluMulLinear,
    can_fuse_silu_mul,
    can_pack,
)


@torch.inference_mode()  # as the engine runs it: with autograd on, a bias that requires grad takes another path
def test_packed_linear_matches_torch_linear_and_survives_deepcopy():
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
    from transformers.activations import ACT2FN

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
    model = llm.engine.runner.model
    assert isinstance(model.lm_head, OneDNNLinear)
    assert model.lm_head.weight is model.embed_tokens.weight  # still tied: no second copy
    x = torch.randn(9, model.cfg.hidden_size)
    expected = torch.nn.functional.linear(x, model.embed_tokens.weight)
    torch.testing.assert_close(model.lm_head(x), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model.lm_head(x[:2]), model.lm_head(x)[:2], rtol=0, atol=0)
