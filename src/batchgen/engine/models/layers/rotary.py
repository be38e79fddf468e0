"""Rotary position embeddings: HF's rotate-half layout or GLM's interleaved pairs (partial rotary),
with Llama-3 and linear rope scaling."""

from __future__ import annotations

import math

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        factor = scaling["factor"]
        low_freq_factor = scaling["low_freq_factor"]
        high_freq_factor = scaling["high_freq_factor"]
        old_context_len = scaling["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, blended, scaled)
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported (default, linear, llama3)")


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables for every position up to max_positions, looked up per token.

    The tables are head_dim wide whatever rotates, so one op applies them to whole heads:
    - rotate-half (default, HF's Llama): dimension i pairs with i + head_dim / 2; ops.rotary;
    - `interleaved` (GLM-4): dimension 2i pairs with 2i + 1; ops.rotary_interleaved. Only the first
      `rotary_dim` dimensions rotate (partial rotary): past them cos is 1 and sin 0, so those
      dimensions pass through unchanged.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 rotary_dim: int | None = None, interleaved: bool = False):
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if rotary_dim != head_dim and not interleaved:
            raise ValueError(f"partial rotary ({rotary_dim} of {head_dim} dimensions) is supported in the "
                             "interleaved layout only")
        if torch.empty(0).device.type == "meta":  # a model built on the meta device: shapes only (the
            # loader computes the tables on the real device; meta arithmetic would import torch._dynamo)
            self.register_buffer("cos", torch.empty(max_positions, head_dim), persistent=False)
            self.register_buffer("sin", torch.empty(max_positions, head_dim), persistent=False)
            return
        inv_freq = rope_inv_freq(rotary_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # (P, R/2)
        if interleaved:
            # HF's GLM: cos/sin of each frequency repeated for its pair; the pair's first element takes -sin.
            cos = freqs.cos().repeat_interleave(2, dim=-1)  # (P, R)
            sin = torch.stack([-freqs.sin(), freqs.sin()], dim=-1).flatten(-2)  # (P, R)
            passed = head_dim - rotary_dim
            cos = torch.cat([cos, cos.new_ones(max_positions, passed)], dim=-1)  # (P, D)
            sin = torch.cat([sin, sin.new_zeros(max_positions, passed)], dim=-1)  # (P, D)
        else:
            emb = torch.cat([freqs, freqs], dim=-1)  # (P, D)
            cos = emb.cos()
            # sin with its first half negated: what ops.rotary multiplies the half-swapped input by.
            sin = torch.cat([-freqs.sin(), freqs.sin()], dim=-1)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin for a step's positions (T,) as (T, 1, D); computed once per step, used by every layer."""
        cos = self.cos.index_select(0, positions).unsqueeze(1).to(dtype)
        sin = self.sin.index_select(0, positions).unsqueeze(1).to(dtype)
        return cos, sin
