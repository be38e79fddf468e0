"""What a pooling model hands back, with vLLM's names.

The engine's output for a pooling request is a PoolingRequestOutput whose `outputs.data` is the score
head's raw logits at the pooled (last non-pad) token, shape (num_labels,) float32: a reward model's
reward for num_labels 1. `LLM.classify` turns it into a ClassificationRequestOutput (`outputs.probs`)
through vLLM's classify activation (`classify_activation`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from batchgen.engine.core.outputs import RequestMetrics

POOLING_TASKS = ("classify", "reward")


@dataclass
class PoolingOutput:
    """vLLM's: the pooled result of one request."""

    data: torch.Tensor  # (num_labels,) float32: the score head's logits ("reward") or probabilities ("classify")


@dataclass
class PoolingRequestOutput:
    """vLLM's PoolingRequestOutput, plus the prompt tokens the prefix cache supplied (batchgen's)."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]  # the tokens the model read (cut after the pooled token)
    finished: bool = True
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = field(default=None, repr=False)


@dataclass
class ClassificationOutput:
    """vLLM's: the class probabilities of one request."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """vLLM's ClassificationRequestOutput."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0


def classify_activation(logits: torch.Tensor) -> torch.Tensor:
    """vLLM's classify activation over the last dimension: a sigmoid for a single label, else a softmax
    over the labels (float32)."""
    logits = logits.float()
    return torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)


def as_classification(output: PoolingRequestOutput) -> ClassificationRequestOutput:
    """A raw pooling output (logits) as vLLM's classification output (probabilities)."""
    probs = classify_activation(output.outputs.data).tolist()
    return ClassificationRequestOutput(output.request_id, ClassificationOutput(probs), output.prompt_token_ids,
                                       output.finished, output.num_cached_tokens)
