"""Mixture-of-experts arithmetic for the capacity plan and the stats: every expert is resident, but a token
reads only its top-k experts' weights.

- `expert_block_bytes`: one MoE layer's router and routed experts as the engine holds them (in the model
  dtype; with FP8 at load (`is_fp8`) the experts' weights as E4M3 bytes with a float32 scale per (expert,
  output channel), quant/fp8_experts.py; int8 / int4 at load quantize only the other linear layers), what
  takes the place of the dense MLP in kv/capacity.weight_bytes. Experts published in MXFP4 (gpt-oss,
  moe_expert_format "mxfp4") are counted as the engine holds them: dequantized at load into the model
  dtype (or E4M3 under FP8 at load), not at their packed 17 bytes per 32 values on disk -- no kernel
  reads them packed yet, and a plan that priced them packed would promise memory the engine does not keep;
- `num_parameters` / `num_active_parameters` (kv/capacity.py): all weights, and those one token runs through (its k
  experts of each MoE layer; embeddings and lm_head included, as model cards count "activated");
- `decode_weight_bytes` (kv/capacity.py): the weight bytes one decode step of `batch` sequences reads: everything but the
  routed experts once, and of each MoE layer's experts the number a batch touches in expectation under
  uniform routing, E x (1 - (1 - k/E)^batch): k at batch 1, approaching E as the batch grows. The
  decode-time bandwidth estimate divides a memory bandwidth by it.
"""

from __future__ import annotations

from batchgen.engine.models.config import ModelConfig


def num_moe_layers(cfg: ModelConfig) -> int:
    return sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))


def expert_block_bytes(cfg: ModelConfig, element_bytes: int, is_fp8: bool = False) -> int:
    """Router (E x H, plus E bias values with moe_router_bias) and the E routed experts, one MoE layer."""
    router = cfg.num_experts * cfg.hidden_size + (cfg.num_experts if cfg.moe_router_bias else 0)
    return router * element_bytes + cfg.num_experts * expert_bytes(cfg, element_bytes, is_fp8)


FP8_EXPERT_SCALE_BYTES = 4  # float32, one per (expert, output channel)


def expert_bytes(cfg: ModelConfig, element_bytes: int, is_fp8: bool = False) -> int:
    """One routed expert as the engine holds it: its parameters in `element_bytes` each (MXFP4 experts
    too: dequantized at load); `is_fp8` (FP8 at load): its weights one byte each and a float32 scale per
    output channel (2I + H), its biases in `element_bytes`."""
    if cfg.moe_expert_format not in ("", "mxfp4"):
        raise ValueError(f"moe_expert_format {cfg.moe_expert_format!r} is not one of '', 'mxfp4'")
    if is_fp8:
        inter, hidden = cfg.moe_intermediate_size, cfg.hidden_size
        biases = (2 * inter + hidden) if cfg.moe_expert_bias else 0
        return 3 * inter * hidden + (2 * inter + hidden) * FP8_EXPERT_SCALE_BYTES + biases * element_bytes
    return expert_parameters(cfg) * element_bytes


def expert_parameters(cfg: ModelConfig) -> int:
    """One routed expert's parameters: gate, up (I x H each) and down (H x I), and their biases (gpt-oss:
    2I + H)."""
    inter, hidden = cfg.moe_intermediate_size, cfg.hidden_size
    return 3 * inter * hidden + ((2 * inter + hidden) if cfg.moe_expert_bias else 0)
