"""gpt-oss's mixture-of-experts block on the shared MoE layer against transformers' own GptOssMLP: a router
with a bias (the top k logits, then a softmax over them), experts with biases whose gate and up
projections transformers holds interleaved in one (E, H, 2I) tensor, and the clamped SwiGLU (gate clamped
above at swiglu_limit, up to [-limit, limit], (up + 1) * gate * sigmoid(1.702 gate)). Inputs are scaled
so that the clamps bind on some rows (asserted). This is its MoE half alone; the whole model against
transformers' is tests/engine/models/test_gpt_oss.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from batchgen.engine.models.config import ModelConfig
from batchgen.engine.models.layers.moe import SparseMoE, gpt_oss_expert_tensors
from batchgen.kernels.fused_moe import silu_mul_rows

CONFIG = dict(hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_hidden_layers=2, vocab_size=128, swiglu_limit=7.0)


@torch.no_grad()
def test_the_gpt_oss_block_equals_transformers_gpt_oss_mlp():
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    hf_config = transformers.GptOssConfig(**CONFIG)
    torch.manual_seed(0)
    hf = GptOssMLP(hf_config).float().eval()
    for param in hf.parameters():
        param.normal_(0.0, 0.3)
    cfg = ModelConfig.from_hf_dict({**hf_config.to_dict(), "architectures": ["GptOssForCausalLM"]}, is_plan_only=True)
    assert (cfg.moe_router, cfg.moe_router_bias, cfg.moe_expert_bias, cfg.moe_swiglu_limit) == (
        "topk_softmax", True, True, 7.0)
    ours = SparseMoE(cfg).eval()
    ours.gate.weight.copy_(hf.router.weight)
    ours.gate.bias.copy_(hf.router.bias)
    experts = hf.experts
    for name, tensor in gpt_oss_expert_tensors(experts.gate_up_proj, experts.gate_up_proj_bias, experts.down_proj,
                                               experts.down_proj_bias).items():
        getattr(ours.experts, name).copy_(tensor)

    x = torch.randn(96, 64, generator=torch.Generator().manual_seed(1)) * 2.0
    gate_up = torch.einsum("th,ehf->tef", x, experts.gate_up_proj) + experts.gate_up_proj_bias  # every expert
    assert (gate_up[..., 0::2] > 7.0).any() and (gate_up[..., 1::2].abs() > 7.0).any()  # both clamps bind
    expected, _ = hf(x[None])
    got = ours(x, SimpleNamespace(silu_mul=silu_mul_rows))
    assert torch.allclose(got, expected[0], rtol=1e-5, atol=1e-5), (got - expected[0]).abs().max()
    routed = torch.topk(torch.nn.functional.linear(x, hf.router.weight, hf.router.bias), 4, dim=-1).indices
    assert set(routed.flatten().tolist()) == set(range(8))  # every expert received tokens


@torch.no_grad()
def test_mxfp4_experts_as_published_give_transformers_dequantized_block():
    """Random MXFP4 blocks and scales in gpt-oss's checkpoint layout: the Experts tensors dequantized here
    equal transformers' own dequantization (convert_moe_packed_tensors) passed through the bf16 layout
    conversion, and the block then equals GptOssMLP holding transformers' dequantized weights."""
    import transformers
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    from batchgen.engine.models.layers.moe import gpt_oss_mxfp4_expert_tensors

    gen = torch.Generator().manual_seed(3)
    num, hidden, inter = 8, 64, 32
    gate_up_blocks = torch.randint(0, 256, (num, 2 * inter, hidden // 32, 16), generator=gen, dtype=torch.uint8)
    gate_up_scales = torch.randint(122, 128, (num, 2 * inter, hidden // 32), generator=gen, dtype=torch.uint8)
    down_blocks = torch.randint(0, 256, (num, hidden, inter // 32, 16), generator=gen, dtype=torch.uint8)
    down_scales = torch.randint(122, 128, (num, hidden, inter // 32), generator=gen, dtype=torch.uint8)
    gate_up_bias, down_bias = torch.randn(num, 2 * inter, generator=gen), torch.randn(num, hidden, generator=gen)
    ours = gpt_oss_mxfp4_expert_tensors(gate_up_blocks, gate_up_scales, gate_up_bias, down_blocks, down_scales,
                                        down_bias)
    hf_config = transformers.GptOssConfig(**CONFIG)
    hf = GptOssMLP(hf_config).float().eval()
    hf.experts.gate_up_proj.copy_(convert_moe_packed_tensors(gate_up_blocks, gate_up_scales, dtype=torch.float32))
    hf.experts.down_proj.copy_(convert_moe_packed_tensors(down_blocks, down_scales, dtype=torch.float32))
    hf.experts.gate_up_proj_bias.copy_(gate_up_bias)
    hf.experts.down_proj_bias.copy_(down_bias)
    torch.manual_seed(4)
    hf.router.weight.normal_(0.0, 0.3)
    hf.router.bias.normal_(0.0, 0.3)
    converted = gpt_oss_expert_tensors(hf.experts.gate_up_proj, hf.experts.gate_up_proj_bias, hf.experts.down_proj,
                                       hf.experts.down_proj_bias)
    assert all(torch.equal(ours[name], converted[name]) for name in converted)
    cfg = ModelConfig.from_hf_dict({**hf_config.to_dict(), "architectures": ["GptOssForCausalLM"]}, is_plan_only=True)
    block = SparseMoE(cfg).eval()
    block.gate.weight.copy_(hf.router.weight)
    block.gate.bias.copy_(hf.router.bias)
    for name, tensor in ours.items():
        getattr(block.experts, name).copy_(tensor)
    x = torch.randn(64, 64, generator=gen)
    expected, _ = hf(x[None])
    assert torch.allclose(block(x, SimpleNamespace(silu_mul=silu_mul_rows)), expected[0], rtol=1e-5, atol=1e-5)
