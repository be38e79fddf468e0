"""The torch references themselves against what no one here wrote: HF transformers' Llama modules
and SDPA on the keys as written (not read back through the block tables)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from batchgen.kernels.reference import (
    add_rms_norm_ref,
    argmax_log_z_ref,
    paged_attention_reference,
    rms_norm_ref,
    rotary_ref,
    silu_mul_ref,
)
from tests.kernels.helpers import rotary_tables, scattered_paged_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_ref_is_hf_llama_rms_norm_bit_for_bit(dtype):
    torch.manual_seed(0)
    for num_tokens in (1, 64, 333):
        x = (torch.randn(num_tokens, 576) * 3).to(dtype)
        hf = LlamaRMSNorm(576, eps=1e-5).to(dtype)
        hf.weight.data.normal_()
        torch.testing.assert_close(rms_norm_ref(x, hf.weight, 1e-5), hf(x), rtol=0, atol=0)


def test_add_rms_norm_ref_is_hf_residual_add_then_norm():
    torch.manual_seed(0)
    x, residual = torch.randn(64, 576) * 3, torch.randn(64, 576)
    hf = LlamaRMSNorm(576, eps=1e-5)
    hf.weight.data.normal_()
    before = residual.clone()
    normed, total = add_rms_norm_ref(x, residual, hf.weight, 1e-5)
    torch.testing.assert_close(total, residual + x, rtol=0, atol=0)  # HF's decoder layer: residual + hidden
    torch.testing.assert_close(normed, hf(residual + x), rtol=0, atol=0)
    assert torch.equal(residual, before)  # the reference writes nothing


def test_silu_mul_ref_is_hf_llama_mlp_activation():
    gate_up = torch.randn(300, 2 * 1536, generator=torch.Generator().manual_seed(0)) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(silu_mul_ref(gate_up), ACT2FN["silu"](gate) * up, rtol=1e-6, atol=1e-6)


def test_rotary_ref_is_hf_apply_rotary_pos_emb():
    torch.manual_seed(0)
    num_tokens, num_heads, head_dim = 37, 12, 64
    hf_cos, hf_sin, cos, signed_sin = rotary_tables(torch.randint(0, 512, (num_tokens,)), head_dim)
    x = torch.randn(num_tokens, num_heads, head_dim)
    hf, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], hf_cos[None], hf_sin[None])
    torch.testing.assert_close(rotary_ref(x, cos, signed_sin), hf[0].transpose(0, 1), rtol=1e-6, atol=1e-6)


def test_paged_decode_ref_is_sdpa_on_each_rows_keys():
    num_kv_heads, group, head_dim, block_size = 2, 3, 32, 4
    lengths = [1, 5, 8, 13]
    k_cache, v_cache, tables, keys, values = scattered_paged_cache(
        lengths, num_kv_heads, head_dim, block_size, seed=3)
    q = torch.randn(len(lengths), num_kv_heads, group, head_dim)
    cu = torch.arange(len(lengths) + 1)  # one query per sequence
    got = paged_attention_reference(q.reshape(len(lengths), -1, head_dim), k_cache, v_cache, tables, cu,
                                    torch.tensor(lengths), 0.3, block_size).view(q.shape)
    assert got.dtype == torch.float32
    for b, (k, v) in enumerate(zip(keys, values)):  # (Hkv, G, D) queries against (Hkv, n, D) keys
        expected = F.scaled_dot_product_attention(q[b], k.transpose(0, 1), v.transpose(0, 1), scale=0.3)
        torch.testing.assert_close(got[b], expected, rtol=1e-5, atol=1e-5)


def test_paged_prefill_ref_is_causal_sdpa_over_context_and_queries():
    num_kv_heads, group, head_dim, block_size = 2, 2, 16, 4
    chunks = [(6, 0), (3, 9), (1, 4)]  # (queries, cached context)
    k_cache, v_cache, tables, keys, values = scattered_paged_cache(
        [q + c for q, c in chunks], num_kv_heads, head_dim, block_size, seed=4)
    num_tokens = sum(q for q, _ in chunks)
    q = torch.randn(num_tokens, group * num_kv_heads, head_dim)
    starts = [sum(n for n, _ in chunks[:i]) for i in range(len(chunks))]
    cu = torch.tensor(starts + [num_tokens])
    out = paged_attention_reference(q, k_cache, v_cache, tables, cu, torch.tensor([n + c for n, c in chunks]),
                                    0.25, block_size)
    for (num_q, context), start, k, v in zip(chunks, starts, keys, values):
        is_visible = torch.arange(context + num_q)[None, :] <= context + torch.arange(num_q)[:, None]
        expected = F.scaled_dot_product_attention(
            q[start:start + num_q].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=is_visible, scale=0.25, enable_gqa=True).transpose(0, 1)
        torch.testing.assert_close(out[start:start + num_q], expected, rtol=1e-5, atol=1e-5)


def test_argmax_log_z_ref_takes_the_first_maximum_and_the_log_normalizer():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0], [-1.0, -1.0, float("-inf"), -3.0]])
    argmax, log_z = argmax_log_z_ref(logits)
    assert argmax.tolist() == [1, 0]
    torch.testing.assert_close(log_z, torch.log(torch.exp(logits).sum(-1)), rtol=1e-6, atol=1e-6)
