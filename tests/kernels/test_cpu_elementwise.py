"""The fused C elementwise kernels against their torch references (kernels/reference.py) and against
HF transformers' own Llama code, on the strided views the model hands them."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from batchgen.kernels import cpu_elementwise
from batchgen.kernels.reference import add_rms_norm_ref, rms_norm_ref, rotary_ref, silu_mul_ref
from tests.kernels.helpers import rotary_tables


def test_the_kernels_build_here():
    assert cpu_elementwise.is_available()  # CI has a C compiler; the model would keep its torch ops


@pytest.mark.parametrize("num_tokens", [1, 64, 333])  # 333 x 576 runs on both threads
def test_add_rms_norm_matches_the_reference_and_hf_residual_add_and_norm(num_tokens):
    torch.manual_seed(0)
    x, residual = torch.randn(num_tokens, 576) * 3, torch.randn(num_tokens, 576)
    hf = LlamaRMSNorm(576, eps=1e-5)
    hf.weight.data.normal_()
    total = residual + x  # HF's decoder layer: residual + hidden
    expected_normed, expected_total = add_rms_norm_ref(x, residual, hf.weight, 1e-5)
    normed, new_residual = cpu_elementwise.add_rms_norm(x, residual.clone(), hf.weight, 1e-5)
    torch.testing.assert_close(new_residual, expected_total, rtol=0, atol=0)
    torch.testing.assert_close(new_residual, total, rtol=0, atol=0)
    torch.testing.assert_close(normed, expected_normed, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(normed, hf(total), rtol=2e-6, atol=2e-6)
    normed_alone = cpu_elementwise.rms_norm(x, hf.weight, 1e-5)
    torch.testing.assert_close(normed_alone, rms_norm_ref(x, hf.weight, 1e-5), rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(normed_alone, hf(x), rtol=2e-6, atol=2e-6)


def test_silu_mul_matches_the_reference_and_hf_llama_mlp_activation():
    torch.manual_seed(0)
    gate_up = torch.randn(300, 2 * 1536) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    got = cpu_elementwise.silu_mul(gate_up)
    torch.testing.assert_close(got, silu_mul_ref(gate_up), rtol=2e-6, atol=2e-6)
    expected = ACT2FN["silu"](gate) * up  # LlamaMLP: act_fn(gate_proj(x)) * up_proj(x)
    torch.testing.assert_close(got, expected, rtol=2e-6, atol=2e-6)


def test_rotary_in_place_on_the_qk_block_of_a_fused_qkv_matches_the_reference_and_hf():
    torch.manual_seed(0)
    num_tokens, num_heads, num_kv_heads, head_dim = 37, 9, 3, 64
    hf_cos, hf_sin, cos, signed_sin = rotary_tables(torch.randint(0, 512, (num_tokens,)), head_dim)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)
    v_before = qkv[:, (num_heads + num_kv_heads) * head_dim:].clone()
    qk = qkv[:, :(num_heads + num_kv_heads) * head_dim].view(num_tokens, num_heads + num_kv_heads, head_dim)
    expected = rotary_ref(qk, cos, signed_sin)
    q, k = qk[:, :num_heads].clone(), qk[:, num_heads:].clone()
    # HF: (B, heads, T, D) with cos/sin (B, T, D).
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                      hf_cos[None], hf_sin[None])
    out = cpu_elementwise.rotary(qk, cos, signed_sin)  # rows strided by the whole qkv row
    assert out.data_ptr() == qk.data_ptr()  # in place
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out[:, :num_heads], q_hf[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out[:, num_heads:], k_hf[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(qkv[:, (num_heads + num_kv_heads) * head_dim:], v_before, rtol=0, atol=0)


def test_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="float32"):
        cpu_elementwise.silu_mul(torch.zeros(2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous rows"):
        cpu_elementwise.rms_norm(torch.zeros(8, 4).t(), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="contiguous heads"):
        # (T, heads, D) = (3, 4, 8) with heads 16 floats apart
        cpu_elementwise.rotary(torch.zeros(3, 4, 16)[:, :, :8], torch.zeros(3, 1, 8), torch.zeros(3, 1, 8))
