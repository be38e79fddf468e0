"""The causal LM: the decoder stack with an lm_head, logits for the rows that are sampled.

Tensor parallelism: the lm_head holds the rank's vocabulary rows (or the whole vocabulary, replicated)
and the logits' column slices are gathered on rank 0 (see `logits`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from batchgen.engine.models.layers.decoder import DecoderModel

if TYPE_CHECKING:
    from batchgen.engine.attention.base import AttentionBackend, AttentionMetadata
    from batchgen.engine.models.config import ModelConfig
    from batchgen.engine.parallel import TensorParallel


class CausalLM(DecoderModel):
    """What a family file subclasses (`*ForCausalLM`); the registry (models/registry.py) names it."""

    def __init__(self, cfg: ModelConfig, max_positions: int, attention_backend: AttentionBackend,
                 parallel: TensorParallel | None = None):
        """`cfg`: the shapes of this model's modules; with `parallel`, the rank's (layout.rank_config)."""
        super().__init__(cfg, max_positions, attention_backend, parallel)
        # The logits' width: the whole vocabulary (a rank's lm_head holds a slice of it).
        self.vocab_size = cfg.vocab_size if parallel is None else parallel.layout.vocab_size
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        # Re-run after to_empty()/to(): those make fresh tensors and would untie the pair.
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def is_tied_checkpoint_name(self, target: str) -> bool:
        """A checkpoint tensor this model does not load because it shares another's storage (lm_head
        tied to the embeddings)."""
        return target == "lm_head.weight" and self.cfg.tie_word_embeddings

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple],
                meta: AttentionMetadata, logits_indices: torch.Tensor,
                hidden_indices: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
        """input_ids, positions: (T,); returns logits (N, V) for the N rows in logits_indices only
        (tensor-parallel: see `logits` for what a worker gets), and with `hidden_indices` (R,) also those
        rows' normed final hidden states (R, H), whose logits the caller makes a slice at a time (prompt
        log-probabilities: `lm_head(rows).float()`; one process only)."""
        hidden = self.hidden_states(input_ids, positions, kv_caches, meta)  # (T, hidden)
        logits = self.logits(self.norm(hidden.index_select(0, logits_indices)))  # only rows that will be sampled
        if hidden_indices is None:
            return logits
        return logits, self.norm(hidden.index_select(0, hidden_indices))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """(N, hidden) normed -> (N, V) float32 logits. Tensor-parallel: rank 0 gets them (the ranks'
        vocabulary slices side by side, the padding rows' columns dropped); a worker gets None on the
        CPU (it samples nothing) and the whole logits on CUDA (an all-gather, see group.py)."""
        parallel = self.parallel
        if parallel is None:
            return self.vocab_logits(hidden)
        if not parallel.layout.is_vocab_parallel:  # replicated: rank 0 alone computes them
            return self.vocab_logits(hidden) if parallel.group.is_first else None
        logits = parallel.group.gather_columns(self.lm_head(hidden))  # (N, world x vocab rows) or None
        if logits is None:
            return None
        if logits.shape[1] != self.vocab_size:
            logits = logits[:, :self.vocab_size].contiguous()
        return self.cap_logits(logits.float())

    def vocab_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) normed -> (N, V) float32 logits of this process's lm_head (soft-capped where the
        model caps them); prompt log-probabilities are made through it too."""
        return self.cap_logits(self.lm_head(hidden).float())

    def cap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """float32 logits -> c * tanh(logits / c) for a model with final_logit_softcapping c (Gemma 2),
        else as they are."""
        cap = self.cfg.final_logit_softcapping
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap
