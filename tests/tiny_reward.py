"""Tiny random-weight sequence classifiers (reward models) built by transformers itself, for the
engine's, the pipeline's and the server's reward tests: seeded, float32, eager attention, every weight
(norm gains and the score head included) drawn at random, saved with `save_pretrained` beside the
bundled tokenizer, whose vocabulary they use.

`pairs()` are 40 (conversation, completion) pairs: 10 prompts x 4 completions, so the completions of a
prompt share its chat-template prefix.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.engine.models.test_registry import randomize_weights

TINY_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-6}
PAD_TOKEN_ID = 0
WORDS = ("the cat sat on a warm mat while rain fell over quiet hills and seven ships sailed north "
         "toward bright harbours where old friends waited with bread salt wine and stories").split()


def save_tiny_classifier(architecture: str, hf_tokenizer, folder: Path, num_labels: int = 1, seed: int = 0):
    """transformers' `architecture` (e.g. "LlamaForSequenceClassification"), tiny and random, saved to
    `folder` with the tokenizer; returns the HF model (float32, eval)."""
    import transformers

    model_type = {"Llama": "llama", "Qwen3": "qwen3", "Qwen2": "qwen2"}[architecture.split("For")[0]]
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=len(hf_tokenizer), bos_token_id=1, eos_token_id=2, pad_token_id=PAD_TOKEN_ID,
        tie_word_embeddings=False, num_labels=num_labels, **TINY_SHAPE)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = randomize_weights(getattr(transformers, architecture)(config).float().eval())
    model.save_pretrained(folder)
    hf_tokenizer.save_pretrained(folder)
    return model


def text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def pairs(num_prompts: int = 10, num_completions: int = 4, seed: int = 0) -> list[tuple[list[dict], str]]:
    """(user messages, completion) pairs, `num_completions` per prompt, prompts and completions of
    different lengths."""
    rng = random.Random(seed)
    out = []
    for i in range(num_prompts):
        prompt = [{"role": "user", "content": text(rng, 6 + 3 * i)}]
        out.extend((prompt, text(rng, rng.randint(2, 25))) for _ in range(num_completions))
    return out


def conversation(messages: list[dict], completion: str) -> list[dict]:
    """The scored conversation: the prompt's messages, then the completion as the assistant's turn."""
    return [*messages, {"role": "assistant", "content": completion}]


@torch.no_grad()
def hf_rewards(hf_model, token_lists: list[list[int]], batched: bool) -> torch.Tensor:
    """HF's logits (N, num_labels) float32: one forward per sequence, or one right-padded batch (the
    pad token and an attention mask: HF pools the last non-pad token)."""
    if not batched:
        return torch.cat([hf_model(torch.tensor([ids])).logits for ids in token_lists])
    width = max(len(ids) for ids in token_lists)
    ids = torch.full((len(token_lists), width), PAD_TOKEN_ID)
    mask = torch.zeros_like(ids)
    for row, tokens in enumerate(token_lists):
        ids[row, :len(tokens)] = torch.tensor(tokens)
        mask[row, :len(tokens)] = 1
    return hf_model(ids, attention_mask=mask).logits


@pytest.fixture(scope="module")
def tiny_reward_model(hf_tokenizer, tmp_path_factory):
    """(HF LlamaForSequenceClassification, its folder): one label, a reward model's shape."""
    folder = tmp_path_factory.mktemp("tiny-reward")
    return save_tiny_classifier("LlamaForSequenceClassification", hf_tokenizer, folder), folder
