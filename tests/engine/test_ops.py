"""The model's elementwise ops against HF transformers' own Llama functions."""

from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from batchgen.engine.models import ops
from batchgen.engine.models.rotary import RotaryEmbedding


def test_float32_rms_norm_is_hf_llama_rms_norm_bit_for_bit():
    torch.manual_seed(0)
    for num_tokens in (1, 64, 333):
        x = torch.randn(num_tokens, 576) * 3
        hf = LlamaRMSNorm(576, eps=1e-5)
        hf.weight.data.normal_()
        expected = hf(x)
        torch.testing.assert_close(ops.rms_norm(x, hf.weight, 1e-5), expected, rtol=0, atol=0)


def test_rotary_on_joint_qk_matches_hf_apply_rotary_pos_emb():
    torch.manual_seed(0)
    num_tokens, num_heads, num_kv_heads, head_dim = 37, 9, 3, 64
    rope = RotaryEmbedding(head_dim, 512, 10000.0, None)
    positions = torch.randint(0, 512, (num_tokens,))
    cos, signed_sin = rope.lookup(positions, torch.float32)  # (T, 1, D)
    q = torch.randn(num_tokens, num_heads, head_dim)
    k = torch.randn(num_tokens, num_kv_heads, head_dim)
    # HF: (B, heads, T, D) with cos/sin (B, T, D); its sin is the plain one.
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(positions.float(), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], emb.cos()[None], emb.sin()[None])
    out = ops.rotary(torch.cat([q, k], dim=1), cos, signed_sin)
    torch.testing.assert_close(out[:, :num_heads], q_hf[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out[:, num_heads:], k_hf[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
