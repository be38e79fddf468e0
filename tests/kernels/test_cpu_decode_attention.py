"""The C decode-attention kernel against a float64 reference and against SDPA, on staging-shaped views."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchgen.kernels import cpu_decode_attention


def _reference(q, k, v, lengths, scale):
    """float64: row b's group queries attend keys [0, lengths[b]) of its KV head."""
    out = torch.empty_like(q, dtype=torch.float64)
    for b, n in enumerate(lengths.tolist()):
        scores = torch.einsum("hgd,hld->hgl", q[b].double(), k[b, :, :n].double()) * scale
        out[b] = torch.einsum("hgl,hld->hgd", scores.softmax(-1), v[b, :, :n].double())
    return out.float()


def test_the_kernel_builds_here():
    assert cpu_decode_attention.is_available()  # CI has a C compiler; the engine would fall back to SDPA


@pytest.mark.parametrize("num_kv_heads,group,head_dim", [(3, 3, 64), (2, 4, 32), (1, 1, 16)])
def test_matches_float64_reference_on_strided_staging_views(num_kv_heads, group, head_dim):
    torch.manual_seed(0)
    num_rows, capacity = 7, 48
    # Staging-like storage: more rows and more capacity than this step uses, rows of unequal length.
    storage = torch.randn(2, num_rows + 3, num_kv_heads, capacity, head_dim) * 2
    k, v = storage[0], storage[1]
    lengths = torch.tensor([1, 5, 48, 17, 33, 2, 40], dtype=torch.int32)
    k[3, :, 17:] = float("nan")  # past a row's length nothing is read
    q = torch.randn(num_rows, num_kv_heads, group, head_dim)
    scale = head_dim ** -0.5
    got = cpu_decode_attention.decode_attention(q, k, v, lengths, scale)
    torch.testing.assert_close(got, _reference(q, k, v, lengths, scale), rtol=1e-5, atol=1e-5)


def test_matches_sdpa_with_a_length_mask_at_smollm_shapes():
    torch.manual_seed(1)
    num_rows, num_kv_heads, group, head_dim, capacity = 64, 3, 3, 64, 320
    k = torch.randn(num_rows, num_kv_heads, capacity, head_dim)
    v = torch.randn(num_rows, num_kv_heads, capacity, head_dim)
    lengths = torch.randint(100, 300, (num_rows,), dtype=torch.int32)
    longest = int(lengths.max())
    q = torch.randn(num_rows, num_kv_heads, group, head_dim)
    mask = (torch.arange(longest)[None, :] < lengths[:, None])[:, None, None, :]
    expected = F.scaled_dot_product_attention(q, k[:, :, :longest], v[:, :, :longest], attn_mask=mask)
    got = cpu_decode_attention.decode_attention(q, k, v, lengths, head_dim ** -0.5)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_refuses_rows_longer_than_the_capacity():
    q = torch.randn(2, 1, 1, 8)
    k = torch.randn(2, 1, 4, 8)
    with pytest.raises(ValueError, match="longer than the staged"):
        cpu_decode_attention.decode_attention(q, k, k, torch.tensor([4, 5], dtype=torch.int32), 1.0)


def test_without_a_compiler_it_is_unavailable_and_says_so(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(cpu_decode_attention, "_library", None)
    monkeypatch.setattr(cpu_decode_attention, "_is_tried", False)
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))  # nothing cached there
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with caplog.at_level("WARNING", logger="batchgen.kernels"):
        assert not cpu_decode_attention.is_available()
    assert "using SDPA" in caplog.text
    with pytest.raises(RuntimeError, match="not available"):
        cpu_decode_attention.decode_attention(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 2, 4),
                                              torch.zeros(1, 1, 2, 4), torch.tensor([1], dtype=torch.int32), 1.0)


def test_loading_the_kernel_leaves_denormals_alone():
    """The library is linked without -ffast-math: GCC's crtfastmath would switch this thread to
    flush-to-zero when it is loaded."""
    assert cpu_decode_attention.is_available()
    tiny = torch.tensor([1e-39], dtype=torch.float32)  # a float32 denormal
    assert (tiny * 1.0).item() != 0.0
