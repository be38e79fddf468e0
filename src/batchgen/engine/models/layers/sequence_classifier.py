"""`*ForSequenceClassification`: a family's decoder stack with a `score` head instead of the lm_head.

transformers builds every such class the same way (GenericForSequenceClassification): the decoder's
final-normed hidden states go through `score`, an nn.Linear(hidden, num_labels) without bias, and the
logits of the last token that is not `pad_token_id` (config.json's; the last token when it has none)
are the sequence's. Reward models (Skywork-Reward-Llama-3.1-8B, Skywork-Reward-V2-Qwen3) are this with
num_labels 1.

The engine runs such a model as a pooling model: each request is one prompt-only sequence (prefill, no
sampling, nothing decoded), cut after the token HF pools (`pooled_length`: what follows it cannot
change that token's hidden state in a causal model), and the head's logits at its last position are
the request's result (the runner's pooled rows, engine/pooling/pool_rows.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from batchgen.engine.attention.base import AttentionBackend, AttentionMetadata
    from batchgen.engine.models.config import ModelConfig
    from batchgen.engine.models.layers.causal_lm import CausalLM
    from batchgen.engine.parallel import TensorParallel

CAUSAL_SUFFIX = "ForCausalLM"
CLASSIFIER_SUFFIX = "ForSequenceClassification"


def pooled_length(token_ids: list[int], pad_token_id: int | None) -> int:
    """How many leading tokens HF's sequence classifiers read: up to the rightmost token that is not
    `pad_token_id` (HF: argmax of position x (token != pad), so 1 when every token is the pad token);
    all of them when the config names no pad token."""
    if pad_token_id is None:
        return len(token_ids)
    for i in range(len(token_ids) - 1, -1, -1):
        if token_ids[i] != pad_token_id:
            return i + 1
    return 1


class SequenceClassifierHead:
    """Put before a family's CausalLM class (`classifier_class`): the same decoder, `score` in place of
    the lm_head. The model's output rows are logits (R, num_labels) float32."""

    is_pooling = True

    def __init__(self, cfg: ModelConfig, max_positions: int, attention_backend: AttentionBackend,
                 parallel: TensorParallel | None = None):
        if parallel is not None:
            raise ValueError(f"{cfg.architecture}: sequence classification with tensor_parallel_size > 1 is "
                             "not implemented")
        super().__init__(cfg, max_positions, attention_backend, parallel)
        del self.lm_head  # built on the meta device: nothing was allocated for it
        self.score = nn.Linear(cfg.hidden_size, cfg.num_labels, bias=False)

    @classmethod
    def config_fields(cls, hf_config: dict) -> dict:
        """The family's fields, then the head's: num_labels (HF: len(id2label), 2 by default) and the
        pad token HF's pooling skips."""
        labels = hf_config.get("id2label") or {}
        num_labels = int(hf_config.get("num_labels") or len(labels) or 2)
        names = tuple(str(labels.get(str(i), labels.get(i, f"LABEL_{i}"))) for i in range(num_labels))
        return {**super().config_fields(hf_config), "num_labels": num_labels,
                "pad_token_id": hf_config.get("pad_token_id"), "label_names": names}

    def tie_weights(self) -> None:
        """No lm_head to tie (tie_word_embeddings of the base model does not concern the score head)."""

    def is_tied_checkpoint_name(self, target: str) -> bool:
        return False

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple],
                meta: AttentionMetadata, logits_indices: torch.Tensor,
                hidden_indices: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: (T,); the score head's logits (R, num_labels) float32 at the R flat
        positions of `logits_indices` (a step's pooled rows; none in a step that only fills KV)."""
        if hidden_indices is not None:
            raise ValueError("a sequence classifier has no vocabulary logits (prompt log-probabilities)")
        hidden = self.hidden_states(input_ids, positions, kv_caches, meta)  # (T, hidden)
        return self.score(self.norm(hidden.index_select(0, logits_indices))).float()


def classifier_class(base: type[CausalLM], architecture: str) -> type[CausalLM]:
    """The `*ForSequenceClassification` class of a family: its CausalLM class with the score head."""
    return type(architecture, (SequenceClassifierHead, base), {"__module__": __name__})
