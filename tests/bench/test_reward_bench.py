"""`batchgen bench --workload reward` end to end on a tiny run: a tiny random reward model's folder (used
as it is: already a sequence classifier), the engine with and without the prefix cache, HF's batched
forward as the peer. The rewards agree with HF's; the prefix cache computes each prompt's full blocks
once (the shared-prefix arithmetic: every completion after a prompt's first reuses the prompt's full
blocks). Speed itself is measured by hand (docs/benchmarks/history/serving-report-scoring.md), not here."""

from __future__ import annotations

from batchgen.bench.reward_bench import (
    NUM_COMPLETIONS,
    format_reward_report,
    reward_workload,
    run_reward_bench,
)
from batchgen.bench.workloads import special_token_ids
from batchgen.engine.text.token_prefix import num_shared_prefix
from tests.tiny_reward import tiny_reward_model  # noqa: F401  (fixture)

BLOCK_SIZE = 16


def test_reward_bench_matches_hf_and_computes_each_prompt_once(tiny_reward_model, hf_tokenizer):  # noqa: F811
    _, folder = tiny_reward_model
    result = run_reward_bench(str(folder), num_prompts=5, input_len_min=20, input_len_max=60, output_len=12,
                              seed=3, num_threads=None, is_peer=True, say=lambda _: None,
                              overrides={"kv_cache_memory": "16MiB", "block_size": BLOCK_SIZE,
                                         "max_model_len": 256})
    pairs = reward_workload(5, 20, 60, 12, 3, len(hf_tokenizer), special_token_ids(hf_tokenizer))  # the same
    w, e, p = result["workload"], result["engine"], result["peer"]
    assert w["num_pairs"] == len(pairs) == 5 * NUM_COMPLETIONS and w["num_tokens"] == sum(map(len, pairs))
    assert w["reward_model"] == str(folder)  # a classifier's folder is scored as it is

    # a prompt's completions follow it; each later one finds the prompt's full blocks cached
    hits = 0
    for first in range(0, len(pairs), NUM_COMPLETIONS):
        group = pairs[first:first + NUM_COMPLETIONS]
        prompt_len = min(num_shared_prefix(group[0], ids) for ids in group[1:])
        assert 20 <= prompt_len
        hits += sum(min(prompt_len // BLOCK_SIZE, (len(ids) - 1) // BLOCK_SIZE) for ids in group[1:])
    assert e["num_cached_tokens"] == hits * BLOCK_SIZE > 0
    assert e["num_prefill_tokens"] == w["num_tokens"] - hits * BLOCK_SIZE
    assert e["unshared_num_prefill_tokens"] == w["num_tokens"]  # no prefix cache: every token computed
    assert 0 < e["prefix_cache_hit_rate"] < 1

    assert p["max_abs_reward_diff"] <= 1e-4  # HF's float32 logits at each pair's last token
    assert p["pairs_per_s"] > 0 and p["engine_over_peer"] > 0
    report = format_reward_report(result)
    assert "prefix-cache hit rate" in report and "batchgen / HF" in report
