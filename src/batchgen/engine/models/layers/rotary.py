"""Rotary position embeddings: HF's rotate-half layout or GLM's interleaved pairs; default, linear,
Llama-3, LongRoPE and YaRN scaling, over the whole head or its first channels (partial rotary)."""

from __future__ import annotations

import math

import torch

SCALINGS = ("default", "linear", "llama3", "longrope", "yarn")


def rope_type(scaling: dict | None) -> str:
    """The scaling's name (transformers' `rope_type`, older configs' `type`); "default" for none."""
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def rope_inv_freq(dim: int, theta: float, scaling: dict | None, max_positions: int | None = None) -> torch.Tensor:
    """(dim / 2,) inverse frequencies of a rotary width `dim`. LongRoPE picks its long factors when
    max_positions exceeds original_max_position_embeddings, else its short ones (see RotaryEmbedding)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # (dim / 2,)
    kind = rope_type(scaling)
    if kind == "longrope":
        # HF's _compute_longrope_parameters: 1 / (factor_i * theta^(2i / dim)), in that order.
        return 1.0 / (longrope_factors(scaling, dim, max_positions) * theta ** exponents)
    inv_freq = 1.0 / (theta ** exponents)
    if kind == "default":
        return inv_freq
    if kind == "yarn":
        return yarn_inv_freq(dim, theta, scaling, inv_freq)
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
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
    raise ValueError(f"rope_scaling type {kind!r} is not supported ({', '.join(SCALINGS)})")


def yarn_inv_freq(dim: int, theta: float, scaling: dict, inv_freq: torch.Tensor) -> torch.Tensor:
    """YaRN (Qwen3's and gpt-oss's long context): the frequencies that turn fewer than beta_slow times over
    the original context are interpolated (divided by `factor`), those turning more than beta_fast times
    kept, a linear ramp between, over the frequency indices (HF's _compute_yarn_parameters; `truncate`,
    default true, rounds the ramp's ends outward)."""
    factor = scaling["factor"]
    original = scaling.get("original_max_position_embeddings")
    if original is None:
        raise ValueError("rope_scaling yarn needs original_max_position_embeddings")
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def index_of(rotations: float) -> float:  # the frequency index turning `rotations` times over `original`
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = index_of(beta_fast), index_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # the share of each frequency left as it is
    return inv_freq / factor * (1 - kept) + inv_freq * kept


def longrope_factors(scaling: dict, dim: int, max_positions: int | None) -> torch.Tensor:
    """(dim / 2,) LongRoPE's per-frequency divisors: `long_factor` when the model is run past its
    original context (max_positions > original_max_position_embeddings), else `short_factor`."""
    original = scaling["original_max_position_embeddings"]
    key = "long_factor" if max_positions is not None and max_positions > original else "short_factor"
    factors = scaling[key]
    if len(factors) != dim // 2:
        raise ValueError(f"rope_scaling {key} has {len(factors)} entries; a rotary width of {dim} needs "
                         f"{dim // 2}")
    return torch.tensor(factors, dtype=torch.float32)


def rope_attention_factor(scaling: dict | None) -> float:
    """What cos and sin are multiplied by: LongRoPE's `attention_factor`, by default
    sqrt(1 + ln(factor) / ln(original_max_position_embeddings)) (1 when factor <= 1), in the short
    and the long regime alike; YaRN's `attention_factor`, by default 0.1 ln(factor) + 1 (with `mscale`
    and `mscale_all_dim`, DeepSeek's: the ratio of that formula at each); 1 for the other scalings."""
    kind = rope_type(scaling)
    if kind == "yarn":
        if scaling.get("attention_factor") is not None:
            return float(scaling["attention_factor"])
        factor = scaling["factor"]

        def mscale(weight: float = 1.0) -> float:
            return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0

        if scaling.get("mscale") and scaling.get("mscale_all_dim"):
            return mscale(scaling["mscale"]) / mscale(scaling["mscale_all_dim"])
        return mscale()
    if kind != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling["factor"]
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(scaling["original_max_position_embeddings"]))


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables for every position up to max_positions, looked up per token.

    `dim`: the channels of a head that turn (head_dim, or less with partial rotary).
    - rotate-half (default, HF's Llama): channel i pairs with i + dim / 2; ops.rotary. With partial
      rotary the attention layer turns the first `dim` channels of each head and passes the rest.
    - `interleaved` (GLM-4): channel 2i pairs with 2i + 1; ops.rotary_interleaved. The tables are
      `head_dim` wide: past `dim` cos is 1 and sin 0, so those channels pass through the one op.
    LongRoPE: one set of factors for the whole model, chosen by max_positions (the engine's
    max_model_len) as vLLM chooses it; HF's class instead switches per forward on the sequence's
    current length, so the two agree when every sequence stays within original_max_position_embeddings
    (max_model_len at most that: short factors) or every sequence's prompt is already longer
    (max_model_len above it: long factors).
    """

    def __init__(self, dim: int, max_positions: int, theta: float, scaling: dict | None,
                 interleaved: bool = False, head_dim: int | None = None):
        super().__init__()
        if dim % 2:
            raise ValueError(f"rotary width {dim} is odd (head_dim x partial_rotary_factor must be even)")
        width = (head_dim or dim) if interleaved else dim  # the tables' width
        if torch.empty(0).device.type == "meta":  # a model built on the meta device: shapes only (the
            # loader computes the tables on the real device; meta arithmetic would import torch._dynamo)
            self.register_buffer("cos", torch.empty(max_positions, width), persistent=False)
            self.register_buffer("sin", torch.empty(max_positions, width), persistent=False)
            return
        inv_freq = rope_inv_freq(dim, theta, scaling, max_positions)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # (P, dim/2)
        scale = rope_attention_factor(scaling)
        if interleaved:
            # HF's GLM: cos/sin of each frequency repeated for its pair; the pair's first element takes -sin.
            cos = freqs.cos().repeat_interleave(2, dim=-1) * scale  # (P, dim)
            sin = torch.stack([-freqs.sin(), freqs.sin()], dim=-1).flatten(-2) * scale  # (P, dim)
            cos = torch.cat([cos, cos.new_ones(max_positions, width - dim)], dim=-1)  # (P, head_dim)
            sin = torch.cat([sin, sin.new_zeros(max_positions, width - dim)], dim=-1)  # (P, head_dim)
        else:
            cos = torch.cat([freqs, freqs], dim=-1).cos() * scale  # (P, dim)
            # sin with its first half negated: what ops.rotary multiplies the half-swapped input by.
            sin = torch.cat([-freqs.sin(), freqs.sin()], dim=-1) * scale
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin for a step's positions (T,) as (T, 1, dim); computed once per step, used by
        every layer."""
        cos = self.cos.index_select(0, positions).unsqueeze(1).to(dtype)
        sin = self.sin.index_select(0, positions).unsqueeze(1).to(dtype)
        return cos, sin
