"""Tensor parallelism on the CPU (gloo, 2 processes) against one process on the bundled model, float32.

One tp=2 engine for the module (its worker loads once). The run: 16 prompts x 32 greedy tokens, 8 of
them behind one long shared system prompt, in a pool small enough to preempt, with a step budget that
admits the shared prompts over several steps (so the later ones hit the first one's cached prefix).
The same run on the session's weights in one process is the reference: tokens equal, every sampled
row's logits within 1e-4 (the all-reduces sum in another order), and the schedule the same
(preemptions and prefix-cache hits happen in both, at the same steps).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.kv.capacity import weight_bytes
from batchgen.engine.parallel.layout import all_layouts
from tests.conftest import MODEL, TEST_ENGINE_KWARGS
from tests.engine.helpers import captured_logits, relative_error, run_requests
from tests.engine.prefix_prompts import OTHER_SYSTEM, chat, user_message
from tests.engine.prompts import QUESTIONS

pytestmark = pytest.mark.subprocess

NUM_TOKENS = 32
# 8 prompts behind one system prompt (~127 tokens, 7 shared blocks) and 8 short ones (~37 tokens): 71
# blocks at the end with the prefix cached once; 40 blocks preempt. 128 tokens a step admit the
# shared prompts one by one.
SETTINGS = dict(TEST_ENGINE_KWARGS, max_model_len=512, num_kv_blocks=40, max_num_batched_tokens=128)
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, max_tokens=16, seed=1234)


def prompts() -> list:
    return [chat(user_message(i), OTHER_SYSTEM) for i in range(8)] + [[{"role": "user", "content": q}]
                                                                      for q in QUESTIONS[:8]]


def greedy_run(engine) -> tuple[dict, dict, dict]:
    """(tokens by request, logits by (request, sample, position), the engine's counters for the run)."""
    before = dict(engine.stats)
    with captured_logits(engine) as logits:
        outputs = run_requests(engine, {f"p{i}": (p, GREEDY) for i, p in enumerate(prompts())})
    after = engine.stats
    counts = {k: after[k] - before[k] for k in ("num_preemptions", "num_cached_tokens", "num_steps")}
    return {k: v.outputs[0].token_ids for k, v in outputs.items()}, logits, counts


@pytest.fixture(scope="module")
def reference(llm):
    """The one-process run, before the tp=2 engine exists (it takes the pytest process's torch threads)."""
    engine = llm.with_engine_settings(**{k: SETTINGS[k] for k in ("max_model_len", "num_kv_blocks",
                                                                  "max_num_batched_tokens")}).engine
    greedy = greedy_run(engine)
    sampled = run_requests(engine, {f"s{i}": (p, SAMPLED) for i, p in enumerate(prompts()[:8])})
    return greedy, {k: v.outputs[0].token_ids for k, v in sampled.items()}


@pytest.fixture(scope="module")
def tp_llm(reference):
    threads = torch.get_num_threads()
    llm = LLM(MODEL, tensor_parallel_size=2, **SETTINGS)
    yield llm
    llm.engine.shutdown()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tp_greedy(tp_llm):
    return greedy_run(tp_llm.engine)


def test_greedy_tokens_equal_one_process(reference, tp_greedy):
    (tokens, _, _), _ = reference
    tp_tokens, _, _ = tp_greedy
    assert len(tp_tokens) == 16 and all(len(t) == NUM_TOKENS for t in tp_tokens.values())
    assert tp_tokens == tokens


def test_logits_within_1e4_of_one_process(reference, tp_greedy):
    """Every sampled row, relative to its largest logit (tests/engine/helpers.relative_error, the HF
    parity tests' criterion); measured here: ~4e-6 relative, ~1e-4 absolute on logits up to ~25."""
    (_, logits, _), _ = reference
    _, tp_logits, _ = tp_greedy
    assert tp_logits.keys() == logits.keys() and len(logits) == 16 * NUM_TOKENS
    worst = max(relative_error(tp_logits[k], logits[k]) for k in logits)
    largest = max((tp_logits[k] - logits[k]).abs().max().item() for k in logits)
    print(f"tp=2 vs tp=1 logits: worst relative {worst:.2e}, largest absolute difference {largest:.2e}")
    assert worst <= 1e-4
    assert largest <= 1e-3
    assert worst > 0  # the sums really ran in another order: a difference exists, under the bound


def test_the_run_preempts_and_hits_the_prefix_cache_like_one_process(reference, tp_greedy):
    (_, _, counts), _ = reference
    _, _, tp_counts = tp_greedy
    assert tp_counts["num_preemptions"] > 0 and tp_counts["num_cached_tokens"] >= 112
    assert tp_counts == counts


def test_seeded_samples_equal_one_process(reference, tp_llm, tp_greedy):
    _, sampled = reference
    outputs = run_requests(tp_llm.engine, {f"s{i}": (p, SAMPLED) for i, p in enumerate(prompts()[:8])})
    assert {k: v.outputs[0].token_ids for k, v in outputs.items()} == sampled
    assert len({tuple(t) for t in sampled.values()}) > 1


def test_what_forks_sequences_or_gathers_prompt_rows_is_refused_not_run_wrong(tp_llm):
    # The workers receive no block copies and the vocabulary-parallel head gathers sampled rows only.
    engine = tp_llm.engine
    with pytest.raises(ValueError, match="beam search .* not implemented with tensor_parallel_size > 1"):
        engine.add_request("beam", [1, 2, 3], SamplingParams(beam_width=2, temperature=0, max_tokens=2))
    with pytest.raises(ValueError, match="prompt_logprobs is not implemented with tensor_parallel_size > 1"):
        engine.add_request("plp", [1, 2, 3], SamplingParams(prompt_logprobs=0, max_tokens=2))
    with pytest.raises(ValueError, match="scoring continuations is not implemented"):
        engine.add_score_request("score", [1, 2, 3], [[4], [5]])
    assert not engine.has_unfinished()


def test_each_rank_holds_its_shard_and_its_kv_heads(llm, tp_llm):
    """Measured tensor storage per rank against the capacity arithmetic on each rank's shapes, and
    against one process: the bundled model's 3 KV heads split 1 + 2 (whole KV groups), so rank 0 holds
    47% and rank 1 53% of the one-process weights; only the norms are held twice."""
    report = tp_llm.engine.stats["tensor_parallel"]
    cfg = tp_llm.engine.model_cfg
    layouts = all_layouts(cfg, 2)
    whole = llm.engine.weight_bytes
    assert whole == weight_bytes(cfg, torch.float32)
    for rank, layout in zip(report["ranks"], layouts):
        rank_cfg = layout.rank_config(cfg)
        assert rank["weight_bytes"] == weight_bytes(rank_cfg, torch.float32)
        assert 0.44 * whole < rank["weight_bytes"] < 0.56 * whole
        assert rank["kv_bytes_per_token"] == 2 * cfg.num_layers * rank_cfg.num_kv_heads * cfg.head_dim * 4
    norms = (2 * cfg.num_layers + 1) * cfg.hidden_size * 4
    assert sum(r["weight_bytes"] for r in report["ranks"]) == whole + norms
    assert [r["kv_bytes_per_token"] // (2 * cfg.num_layers * cfg.head_dim * 4) for r in report["ranks"]] == [1, 2]


def test_int8_ranks_hold_half_the_int8_weights(tp_llm):
    """int8 at load quantizes each rank's shard (per-channel scales of its rows); measured per rank."""
    settings = dict(SETTINGS, quantization="int8", int_calibration="none")
    int8 = LLM(MODEL, tensor_parallel_size=2, **settings)
    try:
        ranks = int8.engine.stats["tensor_parallel"]["ranks"]
        cfg = int8.engine.model_cfg
        whole = weight_bytes(cfg, torch.float32, "int8", int_calibration="none")
        for rank, layout in zip(ranks, all_layouts(cfg, 2)):
            assert rank["weight_bytes"] == weight_bytes(layout.rank_config(cfg), torch.float32, "int8",
                                                        int_calibration="none")
            assert 0.44 * whole < rank["weight_bytes"] < 0.56 * whole
        out = int8.generate([prompts()[8]], dataclasses.replace(GREEDY, max_tokens=8))[0]
        assert len(out.outputs[0].token_ids) == 8
    finally:
        int8.engine.shutdown()


def test_speculative_decoding_runs_on_rank_0_and_gives_plain_decoding_tokens(llm, tmp_path):
    """A draft model (the target itself, whole, in rank 0's process) over a tp=2 target: its drafts are
    the target's greedy tokens (all accepted unless tp=2's and tp=1's logits disagree on a near-tie), and
    the tokens are the one-process engine's without speculation. On a tiny random Llama folder
    (head_dim 16) for a short load."""
    from tests.pipeline.tiny_model import write_tiny_model

    model = str(write_tiny_model(tmp_path / "tiny", llm.engine.tokenizer.hf, hidden=64, intermediate=128,
                                 num_heads=4, num_kv_heads=2, weight_std=0.2))
    settings = {"dtype": "float32", "device": "cpu", "max_model_len": 128, "num_kv_blocks": 64}
    requests = {f"t{i}": ([7 + i, 300 + i, 41, 9000 + i], dataclasses.replace(GREEDY, max_tokens=16))
                for i in range(4)}
    plain = run_requests(LLM(model, **settings).engine, requests)
    draft = {"method": "draft_model", "model": model, "num_speculative_tokens": 3, "disable_by_batch_size": 8}
    threads = torch.get_num_threads()
    speculating = LLM(model, tensor_parallel_size=2, speculative=draft, **settings)
    try:
        outputs = run_requests(speculating.engine, requests)
        stats = speculating.engine.stats["speculative"]
    finally:
        speculating.engine.shutdown()
        torch.set_num_threads(threads)
    assert {k: v.outputs[0].token_ids for k, v in outputs.items()} == {k: v.outputs[0].token_ids
                                                                        for k, v in plain.items()}
    assert stats["num_draft_tokens"] > 0 and stats["acceptance_rate"] >= 0.9
