"""The causal LM of a mixture-of-experts family: MoE decoder blocks (layers/moe.py) and the experts'
checkpoint tensors placed apart from the rest."""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from batchgen.engine.models.layers.causal_lm import CausalLM
from batchgen.engine.models.layers.moe import ExpertCheckpoint, MoEDecoderLayer


class MoECausalLM(CausalLM):
    """What an MoE family file subclasses. Mixtral's checkpoints call the block `block_sparse_moe`
    (transformers 5.x renames it `mlp` in memory, as the engine names it)."""

    layer_class: ClassVar[type[nn.Module]] = MoEDecoderLayer

    def checkpoint_target(self, name: str) -> tuple[str, int | None]:
        return super().checkpoint_target(name.replace(".block_sparse_moe.", ".mlp."))

    def is_placed_apart(self, param_name: str) -> bool:
        return ExpertCheckpoint.is_placed_here(param_name)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The expert tensors (per expert, or fused as transformers 5.x holds them) into the (E, ...)
        parameters; the rest through the decoder's loading. Refuses unknown or missing tensors."""
        layout = self.parallel.layout if self.parallel is not None else None
        experts = ExpertCheckpoint(dict(self.named_parameters()), f"{self.cfg.architecture or self.cfg.model_type}",
                                   None if layout is None else layout.moe_intermediate)
        super().load_weights(experts.others(weights))
        experts.check_complete()


def moe_config_fields(hf_config: dict, *, num_experts_key: str, moe_intermediate_key: str, renormalize: bool,
                      dense_layers: tuple[int, ...] = ()) -> dict:
    """The MoE ModelConfig fields of a config.json (transformers 5.x writes `num_local_experts` for
    Qwen3-MoE's `num_experts` too: either is read). ValueError naming the key that is wrong."""
    architecture = (hf_config.get("architectures") or ["?"])[0]
    num_experts = hf_config.get(num_experts_key, hf_config.get("num_local_experts", hf_config.get("num_experts")))
    top_k = hf_config.get("num_experts_per_tok")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"{architecture}: config.json's {num_experts_key} must be a positive integer, got {num_experts!r}")
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"{architecture}: config.json's num_experts_per_tok must be in [1, {num_experts}], got {top_k!r}")
    activation = hf_config.get("hidden_act", "silu")
    if activation != "silu":
        raise ValueError(f"{architecture}: hidden_act {activation!r} is not supported (silu)")
    return {"num_experts": num_experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": int(hf_config[moe_intermediate_key]), "moe_router": "softmax_topk",
            "moe_renormalize": renormalize, "moe_dense_layers": tuple(dense_layers)}


def refuse_sliding_window(architecture: str, window: int | None, max_positions: int) -> None:
    """A window shorter than max_model_len would mask keys (sliding windows are not in the engine's
    attention yet); one at least that long never does."""
    if window is not None and window < max_positions:
        raise ValueError(f"{architecture}: the model sets sliding_window {window}, below max_model_len {max_positions}; "
                         f"sliding-window attention is not supported yet. Set max_model_len to at most {window}")
