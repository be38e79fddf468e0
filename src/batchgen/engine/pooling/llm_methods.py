"""LLM's pooling calls (vLLM's names): `classify`, `reward`, `encode`, for a sequence classifier
(`LLM(model, runner="pooling")`, or runner auto with a `*ForSequenceClassification` checkpoint).

Where batchgen differs from vLLM, on purpose:
- `reward` returns the score head's raw logits at the last non-pad token (a reward model's reward), as
  HF's `AutoModelForSequenceClassification(...).logits` and TRL/OpenRLHF read a reward model. vLLM's
  `reward` runs its "token_classify" task (ALL pooling: one row per token), which is not what users of
  `*ForSequenceClassification` reward models want (vllm#30312).
- `encode` takes pooling_task "classify" or "reward" only (no embeddings, no per-token pooling).
- A conversation (a list of {role, content} messages) is rendered with the model's chat template WITHOUT a
  generation prompt: the whole exchange, the assistant's answer included, is what a reward model reads
  (Skywork-Reward's and TRL's `apply_chat_template(conversation, tokenize=True)`).
- Prompts sharing a prefix are queued one after another, so the prefix cache computes it once
  (`LLM.engine.stats["prefix_cache_hit_rate"]`, each output's `num_cached_tokens`).
"""

from __future__ import annotations

from typing import Any

from batchgen.engine.pooling.outputs import (
    POOLING_TASKS,
    ClassificationRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    as_classification,
    classify_activation,
)
from batchgen.engine.text.chat_template import ChatTemplateOptions

# A conversation is scored whole: no assistant turn header appended after it.
SCORED_CHAT = ChatTemplateOptions(add_generation_prompt=False)


class PoolingMethods:
    """Mixed into LLM: uses its `engine`, `_parsed_prompts`, `_add_all` and `_collect`."""

    def classify(self, prompts: Any, *, use_tqdm: bool = False, truncate_prompt_tokens: int | None = None,
                 pooling_params: Any = None) -> list[ClassificationRequestOutput]:
        """vLLM's `LLM.classify`: each prompt's class probabilities (`outputs.probs`): the score head's
        logits at the last non-pad token through vLLM's classify activation (softmax over the labels;
        a sigmoid for a single label). Prompts as in `generate`; outputs in input order."""
        return [as_classification(out) for out in self._pool(prompts, use_tqdm, truncate_prompt_tokens)]

    def reward(self, prompts: Any, *, use_tqdm: bool = False, truncate_prompt_tokens: int | None = None,
               pooling_params: Any = None) -> list[PoolingRequestOutput]:
        """Each prompt's reward: `outputs.data`, the score head's raw logits (num_labels,) float32 at the
        last non-pad token, equal to HF `AutoModelForSequenceClassification`'s logits (see the module
        docstring for how this differs from vLLM's reward). Outputs in input order."""
        return self._pool(prompts, use_tqdm, truncate_prompt_tokens)

    def encode(self, prompts: Any, pooling_params: Any = None, *, use_tqdm: bool = False,
               truncate_prompt_tokens: int | None = None, pooling_task: str | None = None) -> list[PoolingRequestOutput]:
        """vLLM's generic pooling call: `pooling_task` "classify" (probabilities in `outputs.data`) or
        "reward" (the raw logits). Outputs in input order."""
        if pooling_task not in POOLING_TASKS:
            raise ValueError(f"pooling_task must be one of {', '.join(POOLING_TASKS)}; got {pooling_task!r}")
        outputs = self._pool(prompts, use_tqdm, truncate_prompt_tokens)
        if pooling_task == "classify":
            for out in outputs:
                out.outputs = PoolingOutput(classify_activation(out.outputs.data))
        return outputs

    def _pool(self, prompts: Any, use_tqdm: bool, truncate_prompt_tokens: int | None) -> list[PoolingRequestOutput]:
        if truncate_prompt_tokens is not None and truncate_prompt_tokens < 1:
            raise ValueError(f"truncate_prompt_tokens must be >= 1 or None; got {truncate_prompt_tokens!r}")
        token_lists = [self._pooling_ids(p) for p in self._parsed_prompts(prompts)]
        if truncate_prompt_tokens is not None:  # vLLM's: keep the last k tokens
            token_lists = [ids[-truncate_prompt_tokens:] for ids in token_lists]
        order = prefix_order(token_lists)
        ids_in_order = self._add_all((token_lists[i] for i in order), self.engine.add_pooling_request)
        request_ids = [""] * len(order)
        for position, i in enumerate(order):
            request_ids[i] = ids_in_order[position]
        return self._collect(request_ids, use_tqdm)

    def _pooling_ids(self, parsed) -> list[int]:
        """A parsed prompt's token ids: text encoded as the tokenizer does (its BOS included), token ids
        as given, a conversation rendered whole (SCORED_CHAT)."""
        if parsed.token_ids is not None:
            return parsed.token_ids
        return self.engine.encode(parsed.prompt, chat=SCORED_CHAT)


def prefix_order(token_lists: list[list[int]]) -> list[int]:
    """The order to queue prompts in: sorted by their tokens, so prompts sharing a prefix are neighbours
    and each after the first finds the shared blocks in the prefix cache (admitted in the same step or
    later: a block is registered when its tokens are scheduled)."""
    return sorted(range(len(token_lists)), key=token_lists.__getitem__)
