"""Sampled exactness: 200 seeded requests at temperature 0.8, top-p 0.9 and a repetition penalty give
the same tokens with n-gram drafts and with a deliberately bad draft model as with speculation off.

The target is a tiny random-weight Llama (the bundled tokenizer, 512 logits, peaked logits so that
drafts get accepted); the bad draft is its own first layer alone (a 1-layer cut: same embeddings,
same vocabulary), so most of its drafts are rejected and some kept.
"""

from __future__ import annotations

import random

import pytest

from batchgen.engine import LLM, SamplingParams
from tests.engine.helpers import run_requests
from tests.pipeline.tiny_model import write_tiny_model

TINY = dict(hidden=64, intermediate=128, num_heads=4, num_kv_heads=2, weight_std=1.0, vocab_size=512)
ENGINE = dict(dtype="float32", device="cpu", kv_cache_memory="64MiB", max_model_len=128, max_num_seqs=200)


@pytest.fixture(scope="module")
def tiny_models(llm, tmp_path_factory):
    """(target, bad draft) folders: a 2-layer tiny model and its first layer alone."""
    root = tmp_path_factory.mktemp("spec-tiny")
    target = write_tiny_model(root / "target", llm.engine.tokenizer.hf, num_layers=2, **TINY)
    draft = write_tiny_model(root / "draft", llm.engine.tokenizer.hf, num_layers=1, **TINY)
    return target, draft


def sampled_requests() -> dict:
    """200 requests: 10 token-id prompts (half repeat a pattern, so n-grams match) x 20 seeds."""
    rng = random.Random(7)
    prompts = []
    for i in range(10):
        pattern = [rng.randrange(3, 512) for _ in range(3 + i % 4)]
        prompts.append(pattern * 4 if i % 2 == 0 else [rng.randrange(3, 512) for _ in range(12)])
    return {f"p{i}-s{seed}": (prompt, SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.1,
                                                      max_tokens=12, seed=seed))
            for i, prompt in enumerate(prompts) for seed in range(20)}


def tokens_of(engine) -> dict[str, list[int]]:
    return {rid: out.outputs[0].token_ids for rid, out in run_requests(engine, sampled_requests()).items()}


def test_sampled_tokens_equal_speculation_off(tiny_models):
    target, draft = tiny_models
    off = LLM(str(target), **ENGINE)
    reference = tokens_of(off.engine)
    assert len({tuple(t) for t in reference.values()}) > 150  # the seeds really sample
    for spec in ({"method": "ngram"}, {"method": "draft_model", "model": str(draft)}):
        engine = off.with_engine_settings(speculative={**spec, "num_speculative_tokens": 3,
                                                       "disable_by_batch_size": 200}).engine
        assert tokens_of(engine) == reference, spec
        stats = engine.stats["speculative"]
        print(f"\n{spec['method']} (sampled, tiny target): {stats['num_accepted_tokens']} of "
              f"{stats['num_draft_tokens']} drafts accepted ({stats['acceptance_rate']:.3f})")
        assert stats["num_accepted_tokens"] > 0  # some drafts were kept: the accept path ran
        if spec["method"] == "draft_model":  # a bad draft: most rejected
            assert stats["num_accepted_tokens"] < stats["num_draft_tokens"] / 2
            draft_pool = engine.spec.proposer.engine.kv_cache_manager.pool
            assert not engine.spec.proposer.mirrors and draft_pool.num_free_blocks == draft_pool.num_blocks
        pool = engine.kv_cache_manager.pool
        assert pool.num_free_blocks == pool.num_blocks
