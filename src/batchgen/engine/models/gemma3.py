"""Gemma 3's text model (HF's Gemma3ForCausalLM): Gemma 2's block (gemma2.py) with q/k RMSNorms per
head (Gemma's 1 + w) instead of the attention soft-cap, five local (sliding-window) layers to one global
(`layer_types`, or `sliding_window_pattern` in older configs), and a rotary table per layer kind: the
local layers' plain rope at `rope_local_base_freq` (10,000), the global layers' at `rope_theta`
(1,000,000) with the config's scaling (linear x 8 in the 4B-27B checkpoints).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from batchgen.engine.models.gemma2 import Gemma2ForCausalLM
from batchgen.engine.models.layers.rotary import RotaryEmbedding, rope_type
from batchgen.engine.models.layers.sandwich_norm_decoder import SandwichNormDecoderLayer

if TYPE_CHECKING:
    from batchgen.engine.models.config import ModelConfig

SLIDING, FULL = "sliding_attention", "full_attention"
_LOCAL_THETA = 10_000.0  # transformers' Gemma3TextConfig.default_theta
_GLOBAL_THETA = 1_000_000.0


class LayerKindRotary(nn.Module):
    """One rotary table per layer kind: `lookup` gives {kind: (cos, sin)} for a step's positions, and
    each layer (LayerKindDecoderLayer) takes its own kind's."""

    def __init__(self, tables: dict[str, RotaryEmbedding]):
        super().__init__()
        self.tables = nn.ModuleDict(tables)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {kind: table.lookup(positions, dtype) for kind, table in self.tables.items()}


class LayerKindDecoderLayer(SandwichNormDecoderLayer):
    """Gemma's sandwich-norm block that attends with its layer kind's rotary table."""

    def __init__(self, cfg: ModelConfig, layer_index: int):
        super().__init__(cfg, layer_index)
        self.kind = cfg.layer_types[layer_index] if cfg.layer_types else FULL

    def forward(self, hidden, residual, rope, *args):
        return super().forward(hidden, residual, rope[self.kind], *args)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """HF's Gemma3ForCausalLM (the text-only checkpoints: gemma-3-1b, and the text tower of the larger
    ones when saved as Gemma3ForCausalLM)."""

    layer_class = LayerKindDecoderLayer
    _DEFAULTS = {"sliding_window": 4096, "attn_logit_softcapping": None, "final_logit_softcapping": None,
                 "query_pre_attn_scalar": 256}
    _SLIDING_WINDOW_PATTERN = 6

    @classmethod
    def config_fields(cls, hf_config: dict) -> dict:
        global_rope, local_rope = _rope_parameters(hf_config)
        scaling = global_rope if rope_type(global_rope) != "default" else None
        return {**super().config_fields(hf_config), "qk_norm": True,
                "rope_theta": float(global_rope.get("rope_theta", _GLOBAL_THETA)), "rope_scaling": scaling,
                "rope_local_theta": float(local_rope.get("rope_theta", _LOCAL_THETA))}

    def make_rotary(self, max_positions: int) -> LayerKindRotary:
        cfg = self.cfg
        return LayerKindRotary({
            FULL: RotaryEmbedding(cfg.rotary_dim, max_positions, cfg.rope_theta, cfg.rope_scaling),
            SLIDING: RotaryEmbedding(cfg.rotary_dim, max_positions, cfg.rope_local_theta, None)})


def _rope_parameters(hf_config: dict) -> tuple[dict, dict]:
    """(global, local) rope parameters: transformers >= 5 writes `rope_parameters` per layer kind; older
    configs have rope_theta, rope_scaling and rope_local_base_freq at the top level."""
    params = hf_config.get("rope_parameters")
    if isinstance(params, dict) and (FULL in params or SLIDING in params):
        return dict(params.get(FULL) or {}), dict(params.get(SLIDING) or {})
    global_rope = dict(hf_config.get("rope_scaling") or {})
    if hf_config.get("rope_theta") is not None:
        global_rope["rope_theta"] = hf_config["rope_theta"]
    local_theta = hf_config.get("rope_local_base_freq")
    return global_rope, ({} if local_theta is None else {"rope_theta": local_theta})
