"""The model's elementwise ops, eager and the fused C kernels, against HF transformers' own Llama code."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from batchgen.engine.models import ops
from batchgen.engine.models.rotary import RotaryEmbedding

OP_SETS = {"eager": ops.eager_ops(), "c_kernels": ops.cpu_kernel_ops()}


def test_float32_rms_norm_is_hf_llama_rms_norm_bit_for_bit():
    torch.manual_seed(0)
    for num_tokens in (1, 64, 333):
        x = torch.randn(num_tokens, 576) * 3
        hf = LlamaRMSNorm(576, eps=1e-5)
        hf.weight.data.normal_()
        expected = hf(x)
        torch.testing.assert_close(ops.rms_norm(x, hf.weight, 1e-5), expected, rtol=0, atol=0)


@pytest.mark.parametrize("op_set", OP_SETS)
@pytest.mark.parametrize("num_tokens", [1, 64, 333])  # 333 x 576 runs on both threads in C
def test_add_rms_norm_matches_hf_residual_add_and_norm(op_set, num_tokens):
    torch.manual_seed(0)
    x, residual = torch.randn(num_tokens, 576) * 3, torch.randn(num_tokens, 576)
    hf = LlamaRMSNorm(576, eps=1e-5)
    hf.weight.data.normal_()
    total = residual + x  # HF's decoder layer: residual + hidden
    normed, new_residual = OP_SETS[op_set].add_rms_norm(x, residual.clone(), hf.weight, 1e-5)
    torch.testing.assert_close(new_residual, total, rtol=0, atol=0)
    torch.testing.assert_close(normed, hf(total), rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(OP_SETS[op_set].rms_norm(x, hf.weight, 1e-5), hf(x), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("op_set", OP_SETS)
def test_silu_mul_matches_hf_llama_mlp_activation(op_set):
    torch.manual_seed(0)
    gate_up = torch.randn(300, 2 * 1536) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    expected = ACT2FN["silu"](gate) * up  # LlamaMLP: act_fn(gate_proj(x)) * up_proj(x)
    torch.testing.assert_close(OP_SETS[op_set].silu_mul(gate_up), expected, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("op_set", OP_SETS)
def test_rotary_on_the_qk_block_of_a_fused_qkv_matches_hf_apply_rotary_pos_emb(op_set):
    torch.manual_seed(0)
    num_tokens, num_heads, num_kv_heads, head_dim = 37, 9, 3, 64
    rope = RotaryEmbedding(head_dim, 512, 10000.0, None)
    positions = torch.randint(0, 512, (num_tokens,))
    cos, signed_sin = rope.lookup(positions, torch.float32)  # (T, 1, D)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)
    v_before = qkv[:, (num_heads + num_kv_heads) * head_dim:].clone()
    qk = qkv[:, :(num_heads + num_kv_heads) * head_dim].view(num_tokens, num_heads + num_kv_heads, head_dim)
    q, k = qk[:, :num_heads].clone(), qk[:, num_heads:].clone()
    # HF: (B, heads, T, D) with cos/sin (B, T, D); its sin is the plain one.
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(positions.float(), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], emb.cos()[None], emb.sin()[None])
    out = OP_SETS[op_set].rotary(qk, cos, signed_sin)  # rows strided by the whole qkv row
    torch.testing.assert_close(out[:, :num_heads], q_hf[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out[:, num_heads:], k_hf[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(qkv[:, (num_heads + num_kv_heads) * head_dim:], v_before, rtol=0, atol=0)


def test_the_cpu_float32_model_runs_the_c_kernels(llm):
    """So that the HF parity and greedy-identity tests cover them."""
    assert llm.engine.runner.model.ops.silu_mul is OP_SETS["c_kernels"].silu_mul
