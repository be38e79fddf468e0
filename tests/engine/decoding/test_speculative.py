"""Speculative decoding on the bundled model changes no output: greedy tokens equal speculation off's
with n-gram drafts, the model drafting for itself (preempted) and an FP8 draft; stops cut inside an
accepted run where plain decoding stops; seeded samples alone equal those in a batch of 32 at the
default switch. Plus the n-gram proposer against a brute-force definition, and the settings.
(Sampled exactness on 200 requests: test_speculative_sampled.py; the verify rows: test_speculative_rows.py.)
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from batchgen.engine import SamplingParams
from batchgen.engine.config import EngineConfig, SettingError, SpeculativeConfig
from batchgen.engine.core.scheduler import num_accepted
from batchgen.engine.core.sequence import Sequence
from batchgen.engine.decoding.speculative.ngram import propose_ngram
from batchgen.engine.kv.kv_cache_manager import KVCacheManager
from batchgen.engine.llm import _speculative_alias
from tests.conftest import MODEL
from tests.engine.core.test_stop_conditions import SHORT_ANSWER
from tests.engine.helpers import run_requests
from tests.engine.prompts import CHAT_PROMPTS, LONG_INDEX

GREEDY_32 = SamplingParams(temperature=0, max_tokens=32)
NGRAM = {"method": "ngram"}
SELF_DRAFT = {"method": "draft_model", "model": MODEL}
FP8_DRAFT = {"method": "draft_model", "model": MODEL, "quantization": "fp8"}
ALONE_PROMPTS = CHAT_PROMPTS[:8]  # each at running batch 1
BATCH_PROMPTS = [p for i, p in enumerate(CHAT_PROMPTS[8:]) if i + 8 != LONG_INDEX][:8]  # twice: batch 16


def greedy_outputs(engine, is_batch_only: bool = False) -> dict[str, list[int]]:
    """8 prompts one at a time (unless `is_batch_only`), then 8 prompts twice each (16 running together),
    32 tokens each."""
    outputs = {}
    for i, prompt in enumerate([] if is_batch_only else ALONE_PROMPTS):
        outputs.update(run_requests(engine, {f"alone-{i}": (prompt, GREEDY_32)}))
    outputs.update(run_requests(engine, {f"batch-{i}-{r}": (prompt, GREEDY_32)
                                         for i, prompt in enumerate(BATCH_PROMPTS) for r in range(2)}))
    return {rid: out.outputs[0].token_ids for rid, out in outputs.items()}


@pytest.fixture(scope="module")
def greedy_reference(llm):
    return greedy_outputs(llm.with_engine_settings(max_num_seqs=16).engine)


@pytest.mark.slow
@pytest.mark.parametrize("spec, settings", [
    (NGRAM, {}),
    (SELF_DRAFT, {"num_kv_blocks": 24, "max_model_len": 384}),  # a pool 16 sequences overflow: preemption
    (FP8_DRAFT, {}),
], ids=["ngram", "self-draft-preempted", "fp8-draft"])
def test_greedy_tokens_equal_speculation_off(llm, greedy_reference, spec, settings):
    engine = llm.with_engine_settings(max_num_seqs=16, speculative={**spec, "disable_by_batch_size": 16},
                                      **settings).engine
    # The FP8 draft (its weights dequantized per matmul on the CPU: the slow case) runs the batch of 16
    # only: its point is a draft that disagrees, the prompts alone are the other two cases' cover.
    is_batch_only = spec == FP8_DRAFT
    expected = {rid: ids for rid, ids in greedy_reference.items() if not (is_batch_only and rid.startswith("alone"))}
    assert greedy_outputs(engine, is_batch_only) == expected
    stats = engine.stats["speculative"]
    print(f"\n{spec} acceptance {stats['acceptance_rate']:.3f} of {stats['num_draft_tokens']} drafts, "
          f"{stats['mean_accepted_length']:.2f} tokens per verify, {engine.stats['num_preemptions']} preemptions")
    assert stats["num_draft_tokens"] > 0
    if spec == SELF_DRAFT:
        # The model drafting for itself: every draft is the target's own greedy token, unless the
        # verify chunk's logits and a decode's disagreed.
        assert stats["acceptance_rate"] >= 0.98
        assert engine.stats["num_preemptions"] > 0
    if spec == FP8_DRAFT:
        assert stats["acceptance_rate"] > 0.5  # perturbed, still close
    assert engine.kv_cache_manager.pool.num_free_blocks == engine.kv_cache_manager.pool.num_blocks
    if engine.spec.proposer.__class__.__name__ == "DraftModelProposer":
        draft_pool = engine.spec.proposer.engine.kv_cache_manager.pool
        assert not engine.spec.proposer.mirrors and draft_pool.num_free_blocks == draft_pool.num_blocks


def test_stops_cut_inside_an_accepted_run_as_plain_decoding_does(llm):
    off = llm.with_engine_settings(max_num_seqs=8).engine
    base = run_requests(off, {"free": (CHAT_PROMPTS[3], SamplingParams(temperature=0, max_tokens=64)),
                              "short": (SHORT_ANSWER, SamplingParams(temperature=0, max_tokens=40))})
    tokens = base["free"].outputs[0].token_ids
    text = base["free"].outputs[0].text
    stop_token = next(t for i, t in enumerate(tokens) if i >= 5 and t not in tokens[:i])
    eos_index = len(base["short"].outputs[0].token_ids) - 1
    requests = {
        "eos": (CHAT_PROMPTS[3], SamplingParams(temperature=0, max_tokens=64)),
        "stop-token": (CHAT_PROMPTS[3], SamplingParams(temperature=0, max_tokens=64, stop_token_ids=[stop_token])),
        "stop-string": (CHAT_PROMPTS[3], SamplingParams(temperature=0, max_tokens=64, stop=[text[12:16]])),
        "max-tokens": (CHAT_PROMPTS[3], SamplingParams(temperature=0, max_tokens=7)),
        # EOS banned at the rows below min_tokens (drafts and verify rows alike), then allowed again.
        "min-tokens": (SHORT_ANSWER, SamplingParams(temperature=0, max_tokens=40, min_tokens=eos_index + 6)),
        "ignore-eos": (SHORT_ANSWER, SamplingParams(temperature=0, max_tokens=eos_index + 6, ignore_eos=True)),
    }
    reference = run_requests(off, requests)
    on = llm.with_engine_settings(max_num_seqs=8, speculative={**SELF_DRAFT, "disable_by_batch_size": 8}).engine
    outputs = run_requests(on, requests)
    for rid in requests:
        ours, theirs = outputs[rid].outputs[0], reference[rid].outputs[0]
        assert (ours.token_ids, ours.text, ours.finish_reason, ours.stop_reason) == \
               (theirs.token_ids, theirs.text, theirs.finish_reason, theirs.stop_reason), rid
        assert ours.num_accepted_tokens > 0 and theirs.num_accepted_tokens is None
    assert reference["eos"].outputs[0].finish_reason == "stop" and len(reference["eos"].outputs[0].token_ids) < 64
    assert len(reference["max-tokens"].outputs[0].token_ids) == 7
    assert len(reference["min-tokens"].outputs[0].token_ids) >= eos_index + 6  # the ban acted


# ---- seeded ----------------------------------------------------------------------------------------

def test_seeded_samples_alone_equal_in_a_batch_of_32_at_the_default_switch(llm):
    settings = dict(max_num_seqs=32, speculative=NGRAM)  # default disable_by_batch_size: 4
    # Lengths 4..23, and 4 of them 24 tokens longer: they finish last, speculating once at most 4 run.
    requests = {f"r{i}": (CHAT_PROMPTS[i % 20], SamplingParams(temperature=0.8, top_p=0.95, seed=11,
                                                               max_tokens=4 + (i * 7) % 20 + 24 * (i % 8 == 0)))
                for i in range(32)}
    batch_engine = llm.with_engine_settings(**settings).engine
    together = run_requests(batch_engine, requests)
    stats = batch_engine.stats["speculative"]
    assert stats["num_draft_tokens"] > 0 and stats["num_accepted_tokens"] > 0  # the batch shrank below the switch
    assert together["r8"].outputs[0].num_accepted_tokens > 0
    for rid in ("r8", "r17", "r30"):
        alone = run_requests(llm.with_engine_settings(**settings).engine, {rid: requests[rid]})
        assert alone[rid].outputs[0].token_ids == together[rid].outputs[0].token_ids


# ---- pieces ----------------------------------------------------------------------------------------

def brute_force_ngram(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition: longest suffix n-gram with an earlier occurrence; the first such occurrence."""
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) < n + 1:
            continue
        suffix = tokens[len(tokens) - n:]
        for start in range(len(tokens) - n):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_ngram_proposals_follow_the_definition():
    rng = random.Random(0)
    for _ in range(2000):
        tokens = [rng.randrange(rng.choice([2, 3, 6, 50])) for _ in range(rng.randint(1, 40))]
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        k = rng.randint(1, 5)
        assert propose_ngram(np.array(tokens, dtype=np.int32), k, min_n, max_n) == \
               brute_force_ngram(tokens, k, min_n, max_n), (tokens, k, min_n, max_n)
    copy = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]
    assert propose_ngram(np.array(copy, dtype=np.int32), 3, 1, 4) == [8, 9, 1]


def test_acceptance_keeps_the_leading_agreeing_drafts():
    assert num_accepted([4, 5, 6], [4, 5, 6, 7]) == 3
    assert num_accepted([4, 5, 6], [4, 9, 6, 7]) == 1
    assert num_accepted([4], [3, 4]) == 0


def test_speculative_settings_are_checked_and_aliased():
    config = EngineConfig(model="m", speculative={"method": "ngram", "num_speculative_tokens": 3})
    assert config.speculative == SpeculativeConfig(num_speculative_tokens=3)
    assert config.speculative.max_batch_size == 4
    assert EngineConfig(model="m").speculative is None
    for bad, name in [({"method": "eagle"}, "method"), ({"method": "draft_model"}, "model"),
                      ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
                      ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_max"),
                      ({"disable_by_batch_size": 0}, "disable_by_batch_size")]:
        with pytest.raises(SettingError) as info:
            EngineConfig(model="m", speculative=bad)
        assert info.value.name == name
    with pytest.raises(SettingError, match="unknown key"):
        EngineConfig(model="m", speculative={"num_draft_tokens": 3})
    assert _speculative_alias({"speculative_config": NGRAM}) == {"speculative": NGRAM}
    with pytest.raises(TypeError):
        _speculative_alias({"speculative_config": NGRAM, "speculative": NGRAM})


def test_sdpa_backend_verifies_through_its_prefill_path_with_staged_decodes(sdpa_llm):
    """The SDPA backend stages decoding sequences' KV densely: a sequence that verifies (a prefill
    chunk) leaves its staging row and rejoins at its next plain decode, over the rolled-back context."""
    requests = {f"r{i}": (CHAT_PROMPTS[i], SamplingParams(temperature=0, max_tokens=24)) for i in range(4)}
    off = run_requests(sdpa_llm.with_engine_settings(max_num_seqs=4).engine, requests)
    engine = sdpa_llm.with_engine_settings(max_num_seqs=4, speculative=NGRAM).engine
    on = run_requests(engine, requests)
    assert {r: o.outputs[0].token_ids for r, o in on.items()} == {r: o.outputs[0].token_ids for r, o in off.items()}
    assert engine.stats["kernels"]["attention_backend"] == "sdpa"
    assert engine.stats["speculative"]["num_accepted_tokens"] > 0


def test_rolled_back_drafts_give_back_only_the_blocks_wholly_past_the_new_end():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    seq = Sequence("r", 0, [1, 2, 3, 4, 5], SamplingParams(max_tokens=20), 0.0, 64)
    assert kv.allocate_slots(seq, 5, [])
    seq.num_computed_tokens = 5
    seq.token_ids.append(6)  # 6 tokens, the last one's KV not computed yet
    assert kv.allocate_slots(seq, 1 + 4)  # a verify chunk: positions 5..9, blocks 0..2
    assert len(seq.block_ids) == 3 and kv.pool.num_free_blocks == 5
    seq.num_computed_tokens += 5 - 3  # 1 of 4 drafts accepted: positions 5, 6 kept
    seq.token_ids += [7, 8]  # the accepted draft and the target's token: 8 tokens
    kv.trim(seq)
    assert len(seq.block_ids) == 2 and kv.pool.num_free_blocks == 6  # block 2 held only rejected drafts
    kv.trim(seq)  # nothing more to give back
    assert len(seq.block_ids) == 2
    assert [kv.pool.block_keys[b] is not None for b in seq.block_ids] == [True, False]  # verified tokens only
