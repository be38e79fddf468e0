"""Sequence classifiers (reward models) against transformers' own `*ForSequenceClassification`.

Tiny random Llama and Qwen3 classifiers score 40 chat conversations (10 prompts x 4 completions): the
engine's rewards equal HF's float32 logits within 1e-4, scored one call per pair and all in one call
(prefix cache sharing the prompts, a 48-token step budget chunking the longer ones), and against HF's
own right-padded batch. A 3-label model's `classify` probabilities are vLLM's activation of HF's logits.
"""

from __future__ import annotations

import pytest
import torch

from batchgen.engine import LLM, ClassificationRequestOutput, PoolingRequestOutput
from batchgen.engine.models.layers.sequence_classifier import pooled_length
from tests.tiny_reward import PAD_TOKEN_ID, conversation, hf_rewards, pairs, save_tiny_classifier

TOLERANCE = 1e-4
SETTINGS = dict(dtype="float32", device="cpu", max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=48)


@pytest.fixture(scope="module", params=["LlamaForSequenceClassification", "Qwen3ForSequenceClassification"])
def classifier(request, hf_tokenizer, tmp_path_factory):
    """(HF model, our LLM, the 40 conversations' token ids as HF's tokenizer renders them)."""
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_classifier(request.param, hf_tokenizer, folder)
    conversations = [conversation(m, c) for m, c in pairs()]
    token_lists = [hf_tokenizer.apply_chat_template(c, tokenize=True, return_dict=False) for c in conversations]
    return hf, LLM(str(folder), **SETTINGS), conversations, token_lists


def rewards(outputs: list[PoolingRequestOutput]) -> torch.Tensor:
    return torch.stack([out.outputs.data for out in outputs])


def test_the_runner_is_detected_and_a_generate_call_is_refused(classifier):
    _, llm, _, _ = classifier
    assert llm.engine.is_pooling
    with pytest.raises(ValueError, match="is a pooling model"):
        llm.generate("hello")


def test_rewards_alone_and_in_one_batch_equal_hf_logits(classifier):
    hf, llm, conversations, token_lists = classifier
    assert len(token_lists) == 40
    reference = hf_rewards(hf, token_lists, batched=False)  # (40, 1)
    assert torch.allclose(reference, hf_rewards(hf, token_lists, batched=True), atol=TOLERANCE)
    alone = torch.cat([rewards(llm.reward(c)) for c in conversations[:8]])  # a call per pair
    batched = llm.with_engine_settings().reward(conversations)  # one call, a fresh prefix cache
    assert [out.prompt_token_ids for out in batched] == token_lists  # rendered as HF renders them
    assert (alone - reference[:8]).abs().max().item() <= TOLERANCE
    assert (rewards(batched) - reference).abs().max().item() <= TOLERANCE
    assert sum(out.num_cached_tokens for out in batched) > 0  # the completions of a prompt shared its blocks


def test_token_id_prompts_pool_the_last_token_that_is_not_the_pad_token(classifier):
    hf, llm, _, token_lists = classifier
    padded = [token_lists[0] + [PAD_TOKEN_ID] * 3, token_lists[1], [PAD_TOKEN_ID] * 4]
    out = llm.reward([{"prompt_token_ids": ids} for ids in padded])
    reference = hf_rewards(hf, padded, batched=False)  # HF pools the rightmost non-pad token
    assert (rewards(out) - reference).abs().max().item() <= TOLERANCE
    assert out[0].prompt_token_ids == token_lists[0] and len(out[2].prompt_token_ids) == 1
    assert pooled_length([5, 0, 7, 0, 0], 0) == 3 and pooled_length([5, 0], None) == 2


def test_classify_applies_vllms_activation_to_the_labels(hf_tokenizer, tmp_path):
    hf = save_tiny_classifier("Qwen3ForSequenceClassification", hf_tokenizer, tmp_path, num_labels=3, seed=3)
    llm = LLM(str(tmp_path), runner="pooling", **SETTINGS)
    prompts = ["a short text to classify", "another, somewhat longer text to put in a class"]
    reference = hf_rewards(hf, [hf_tokenizer(p)["input_ids"] for p in prompts], batched=False)  # (2, 3)
    classified = llm.classify(prompts)
    assert all(isinstance(c, ClassificationRequestOutput) and c.outputs.num_classes == 3 for c in classified)
    probs = torch.tensor([c.outputs.probs for c in classified])
    assert torch.allclose(probs, torch.softmax(reference, dim=-1), atol=TOLERANCE)
    raw = llm.encode(prompts, pooling_task="reward")
    assert (rewards(raw) - reference).abs().max().item() <= TOLERANCE
    assert torch.allclose(rewards(llm.encode(prompts, pooling_task="classify")), probs, atol=1e-6)
    with pytest.raises(ValueError, match="pooling_task must be one of classify, reward"):
        llm.encode(prompts)


def test_a_causal_lm_is_refused_as_a_pooling_model_by_name(llm):
    with pytest.raises(ValueError, match=r"has no classification head"):
        llm.reward("hello")
