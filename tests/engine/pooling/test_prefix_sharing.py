"""The completions of one prompt are scored through the prefix cache: the prompt's full blocks are
computed once per pass, and the engine's hit rate is the shared-prefix arithmetic.

Token-id prompts make the arithmetic exact: G groups, each a prefix of S tokens (its own first token,
so groups share nothing) followed by n completions that differ from their first token. A part of
L tokens queries (L - 1) // B blocks (at least its last token is computed); the first part of a group
hits none, each later one min(S // B, (L - 1) // B). Queued in any order, LLM.reward sorts them so a
group's parts are neighbours; the rewards still equal each part scored alone.
"""

from __future__ import annotations

import random

import pytest
import torch

from batchgen.engine import LLM
from tests.tiny_reward import tiny_reward_model  # noqa: F401  (fixture)

BLOCK_SIZE = 16


def groups(num_groups: int, prefix_len: int, num_parts: int, vocab_size: int) -> list[list[list[int]]]:
    rng = random.Random(7)
    out = []
    for g in range(num_groups):
        prefix = [10 + g] + [rng.randrange(3, vocab_size) for _ in range(prefix_len - 1)]
        out.append([prefix + [100 + j] + [rng.randrange(3, vocab_size) for _ in range(rng.randint(0, 40))]
                    for j in range(num_parts)])
    return out


@pytest.mark.parametrize("budget", [4096, 64])  # all in one step; chunked over many
def test_the_hit_rate_is_the_shared_prefix_arithmetic_and_scores_do_not_change(tiny_reward_model, budget):  # noqa: F811
    _, folder = tiny_reward_model
    llm = LLM(str(folder), dtype="float32", device="cpu", max_model_len=256, num_kv_blocks=256,
              block_size=BLOCK_SIZE, max_num_batched_tokens=budget)
    prefix_len = 45  # two full blocks and a partial one
    parts = groups(6, prefix_len, 4, llm.engine.model_cfg.vocab_size)
    shuffled = [ids for group in parts for ids in group]
    random.Random(1).shuffle(shuffled)
    outputs = llm.reward([{"prompt_token_ids": ids} for ids in shuffled])

    queried = sum((len(ids) - 1) // BLOCK_SIZE for ids in shuffled)
    hits = sum(min(prefix_len // BLOCK_SIZE, (len(ids) - 1) // BLOCK_SIZE) for group in parts for ids in group[1:])
    stats = llm.engine.stats
    assert stats["prefix_cache_hit_rate"] == pytest.approx(hits / queried)
    assert sum(out.num_cached_tokens for out in outputs) == hits * BLOCK_SIZE == stats["num_cached_tokens"]
    assert stats["num_prefill_tokens"] == sum(map(len, shuffled)) - hits * BLOCK_SIZE  # computed once

    fresh = llm.with_engine_settings(enable_prefix_caching=False)
    alone = torch.stack([fresh.reward({"prompt_token_ids": ids})[0].outputs.data for ids in shuffled[:6]])
    shared = torch.stack([out.outputs.data for out in outputs[:6]])
    assert (alone - shared).abs().max().item() <= 1e-5
