"""gpt-oss (GptOssForCausalLM): attention with sinks over alternating sliding-window and full layers, and a
mixture-of-experts block with biases and a clamped SwiGLU.

From config.json:
- attention: biases on q/k/v and o_proj (attention_bias); a learned sink logit per query head
  (`self_attn.sinks`) that joins every softmax's denominator and weighs no value; `layer_types`
  (transformers' default when absent: even layers sliding, odd layers full) with `sliding_window`
  (128 in the published models); YaRN rotary (rope_parameters / rope_scaling).
- experts: num_local_experts of them, intermediate_size wide, num_experts_per_tok (older configs:
  experts_per_token) per token; a router with a bias that takes the top k logits and then the softmax
  over those (moe_router "topk_softmax"); biases on every expert's projections; gate and up interleaved
  (gate, up, gate, ...) in one tensor; SwiGLU with the gate clamped above at swiglu_limit, up to
  [-limit, limit], (up + 1) * gate * sigmoid(swiglu_alpha * gate).

Checkpoints: the experts as transformers holds and saves them (`experts.gate_up_proj` (E, H, 2I),
`gate_up_proj_bias` (E, 2I), `down_proj` (E, I, H), `down_proj_bias` (E, H)), or as OpenAI publishes them
(quantization_config quant_method "mxfp4": `*_blocks` / `*_scales` for gate_up_proj and down_proj, the
biases and every other tensor in bf16), dequantized exactly at load (quant/mxfp4.py) into the model
dtype; `batchgen plan` prices such experts at their packed size (kv/expert_bytes.py). The router is
`mlp.router` in the checkpoint (`mlp.gate` here, the MoE layer's name).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from batchgen.engine.models.layers.moe import ExpertCheckpoint
from batchgen.engine.models.layers.moe_causal_lm import MoECausalLM
from batchgen.engine.quant.mxfp4 import dequantize_mxfp4

if TYPE_CHECKING:
    from batchgen.engine.attention.base import AttentionBackend
    from batchgen.engine.models.config import ModelConfig
    from batchgen.engine.parallel import TensorParallel

_DEFAULT_SLIDING_WINDOW = 128  # transformers' GptOssConfig default
# layers.L.mlp.experts.<gate_up_proj|down_proj>[_bias|_blocks|_scales] (the `model.` prefix removed)
_EXPERT_TENSOR = re.compile(r"^(layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(|_bias|_blocks|_scales)$")


class GptOssForCausalLM(MoECausalLM):
    """HF's GptOssForCausalLM (one process: tensor parallelism is refused, its expert biases do not split yet)."""

    def __init__(self, cfg: ModelConfig, max_positions: int, attention_backend: AttentionBackend,
                 parallel: TensorParallel | None = None):
        if parallel is not None and parallel.layout.world_size > 1:
            raise ValueError("GptOssForCausalLM: tensor_parallel_size > 1 is not supported yet (expert biases and "
                             "attention sinks are not split over ranks); run it with tensor_parallel_size 1")
        super().__init__(cfg, max_positions, attention_backend, parallel)

    @classmethod
    def config_fields(cls, hf_config: dict) -> dict:
        num_layers = hf_config["num_hidden_layers"]
        layer_types = hf_config.get("layer_types") or [
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
        if len(layer_types) != num_layers:
            raise ValueError(f"GptOssForCausalLM: config.json's layer_types has {len(layer_types)} entries for "
                             f"{num_layers} layers")
        bias = bool(hf_config.get("attention_bias", True))
        is_mxfp4 = (hf_config.get("quantization_config") or {}).get("quant_method") == "mxfp4"
        return {"num_experts": hf_config.get("num_local_experts", 128),
                "num_experts_per_tok": hf_config.get("num_experts_per_tok", hf_config.get("experts_per_token", 4)),
                "moe_intermediate_size": hf_config["intermediate_size"], "moe_router": "topk_softmax",
                "moe_router_bias": True, "moe_expert_bias": True, "moe_expert_format": "mxfp4" if is_mxfp4 else "",
                "moe_swiglu_limit": float(hf_config.get("swiglu_limit", 7.0)),
                "moe_swiglu_alpha": float(hf_config.get("swiglu_alpha", 1.702)),
                "attention_bias": bias, "o_proj_bias": bias, "attention_sinks": True,
                "rms_norm_eps": hf_config.get("rms_norm_eps", 1e-5),
                "sliding_window": hf_config.get("sliding_window", _DEFAULT_SLIDING_WINDOW),
                "layer_types": tuple(layer_types)}

    def checkpoint_target(self, name: str) -> tuple[str, int | None]:
        return super().checkpoint_target(name.replace(".mlp.router.", ".mlp.gate."))

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The expert tensors (transformers' layout, or MXFP4 blocks and scales) converted into the Experts
        module's (gate rows then up rows, weights out x in), the rest through the decoder's loading.
        Refuses unknown or missing tensors by name."""
        params = dict(self.named_parameters())
        experts = ExpertCheckpoint(params, "GptOssForCausalLM")
        # past MoECausalLM's loading (per-expert / fused (E, 2I, H) tensors): gpt-oss's experts are placed here
        super(MoECausalLM, self).load_weights(self._placing_experts(weights, params, experts))
        experts.check_complete()

    def _placing_experts(self, weights: Iterable[tuple[str, torch.Tensor]], params: dict[str, torch.Tensor],
                         experts: ExpertCheckpoint) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor that is not an expert's, passed on; the experts' copied into place (an MXFP4 weight
        once both its blocks and its scales have come)."""
        packed: dict[str, dict[str, torch.Tensor]] = {}  # target -> {"_blocks": ..., "_scales": ...}
        for hf_name, tensor in weights:
            match = _EXPERT_TENSOR.match(hf_name.removeprefix("model."))
            if match is None:
                yield hf_name, tensor
                continue
            layer, projection, suffix = match.groups()
            target = f"{layer}.mlp.experts.{projection}"
            if suffix in ("_blocks", "_scales"):
                parts = packed.setdefault(target, {})
                parts[suffix] = tensor
                if len(parts) < 2:
                    continue
                del packed[target]
                # published as rows (E, out, in), gate_up's rows interleaved: as transformers' (E, in, out)
                dtype = params[target].dtype if target in params else torch.float32
                suffix, tensor = "", dequantize_mxfp4(parts["_blocks"], parts["_scales"], dtype).transpose(1, 2)
            self._place_expert(target + suffix, projection, suffix, tensor, params, experts, hf_name)
        if packed:
            name = next(iter(packed))
            raise ValueError(f"GptOssForCausalLM: checkpoint has MXFP4 {name} without its "
                             f"{'_scales' if '_blocks' in packed[name] else '_blocks'}")

    @staticmethod
    def _place_expert(target: str, projection: str, suffix: str, tensor: torch.Tensor,
                      params: dict[str, torch.Tensor], experts: ExpertCheckpoint, hf_name: str) -> None:
        """One expert tensor in transformers' layout into its (E, ...) parameter."""
        if target not in params:
            raise ValueError(f"GptOssForCausalLM: checkpoint tensor {hf_name!r} has no place in the model")
        dest = params[target]
        if projection == "gate_up_proj":
            # interleaved gate, up, gate, ... along the last dim -> gate rows then up rows
            tensor = torch.cat((tensor[..., 0::2], tensor[..., 1::2]), dim=-1)
        if suffix == "" and tensor.dim() == 3:
            tensor = tensor.transpose(1, 2)  # transformers' (E, in, out) -> the layer's (E, out, in)
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(f"GptOssForCausalLM: checkpoint tensor {hf_name!r} gives shape {tuple(tensor.shape)}, "
                             f"expected {tuple(dest.shape)}")
        dest.copy_(tensor.to(dest.dtype))
        experts.loaded.add((target, None, None))

