"""SamplingParams.prompt_logprobs against HF transformers' float32 log-softmax on 24 prompts: each prompt
token's log-probability, its rank and the top 3, alone, in a batch, split by chunked prefill, after a
preemption, and with the prompt's first blocks already in the prefix cache (they are recomputed)."""

from __future__ import annotations

import pytest
import torch

from batchgen.engine import SamplingParams
from tests.engine.helpers import run_requests
from tests.engine.prompts import INVARIANCE_PROMPTS

NUM_PROMPTS = 24
NUM_TOP = 3
TOLERANCE = 1e-4
PROMPT_LOGPROBS = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=NUM_TOP)


@pytest.fixture(scope="module")
def prompt_ids(llm) -> list[list[int]]:
    return [llm.engine.encode(messages) for messages in INVARIANCE_PROMPTS[:NUM_PROMPTS]]


@pytest.fixture(scope="module")
def hf_log_softmax(hf_model, prompt_ids) -> list[torch.Tensor]:
    """(P - 1, V) per prompt: HF's log-softmax at every position but the last."""
    out = []
    with torch.no_grad():
        for ids in prompt_ids:
            logits = hf_model(torch.tensor([ids])).logits[0, :-1].float()
            out.append(torch.log_softmax(logits, dim=-1))
    return out


def check(output, ids: list[int], reference: torch.Tensor) -> None:
    """Our prompt_logprobs (vLLM's shape) against HF's log-softmax rows."""
    positions = output.prompt_logprobs
    assert len(positions) == len(ids) and positions[0] is None
    targets = torch.tensor(ids[1:])
    expected = reference.gather(-1, targets[:, None]).squeeze(-1)
    ours = torch.tensor([position[t].logprob for position, t in zip(positions[1:], ids[1:])])
    assert (ours - expected).abs().max().item() <= TOLERANCE
    ranks = [position[t].rank for position, t in zip(positions[1:], ids[1:])]
    assert ranks == ((reference > expected[:, None]).sum(-1) + 1).tolist()
    top_values, top_ids = reference.topk(NUM_TOP, dim=-1)
    for position, want_ids, want_values in zip(positions[1:], top_ids.tolist(), top_values.tolist()):
        # The entries ranked 1..N are the top N (the prompt's own token among them when it is one).
        tops = sorted((lp.rank, token_id, lp.logprob) for token_id, lp in position.items() if lp.rank <= NUM_TOP)
        assert [token_id for _, token_id, _ in tops] == want_ids
        assert max(abs(value - want) for (_, _, value), want in zip(tops, want_values)) <= TOLERANCE


def test_alone_and_in_a_batch(llm, prompt_ids, hf_log_softmax):
    for i in (0, 7, NUM_PROMPTS - 1):  # alone: a few, each its own run
        out = run_requests(llm.engine, {f"alone-{i}": (prompt_ids[i], PROMPT_LOGPROBS)})[f"alone-{i}"]
        check(out, prompt_ids[i], hf_log_softmax[i])
        assert out.num_cached_tokens == 0  # its earlier runs' blocks are recomputed for their logits
    requests = {f"batch-{i}": (ids, PROMPT_LOGPROBS) for i, ids in enumerate(prompt_ids)}
    # n samples of one prompt: the prompt's values once (sample 0 computes them)
    requests["sampled"] = (prompt_ids[3], SamplingParams(temperature=0.8, n=2, seed=1, max_tokens=2,
                                                         prompt_logprobs=NUM_TOP))
    outputs = run_requests(llm.engine, requests)
    for i, ids in enumerate(prompt_ids):
        check(outputs[f"batch-{i}"], ids, hf_log_softmax[i])
    check(outputs["sampled"], prompt_ids[3], hf_log_softmax[3])


def test_split_by_chunked_prefill(chunked_llm, prompt_ids, hf_log_softmax):
    engine = chunked_llm.engine
    before = engine.stats["num_partial_prefills"]
    outputs = run_requests(engine, {f"chunked-{i}": (ids, PROMPT_LOGPROBS) for i, ids in enumerate(prompt_ids)})
    assert engine.stats["num_partial_prefills"] > before  # 64-token steps: long prompts in several chunks
    for i, ids in enumerate(prompt_ids):
        check(outputs[f"chunked-{i}"], ids, hf_log_softmax[i])


def test_after_a_preemption(llm, prompt_ids, hf_log_softmax):
    # 24 blocks and 48-token steps: sequences are preempted mid-prefill and while decoding, and recomputed.
    small = llm.with_engine_settings(num_kv_blocks=24, max_model_len=24 * 16, max_num_batched_tokens=48)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=NUM_TOP)
    chosen = [i for i, ids in enumerate(prompt_ids) if len(ids) + 24 <= 24 * 16][:12]
    outputs = run_requests(small.engine, {f"pre-{i}": (prompt_ids[i], params) for i in chosen})
    assert small.engine.stats["num_preemptions"] > 0
    for i in chosen:
        check(outputs[f"pre-{i}"], prompt_ids[i], hf_log_softmax[i])
    assert all(count == 0 for count in small.engine.kv_cache_manager.pool.ref_counts)


def test_prompt_blocks_in_the_prefix_cache_are_recomputed(llm, prompt_ids, hf_log_softmax):
    engine = llm.with_engine_settings(max_num_seqs=8).engine
    chosen = [i for i, ids in enumerate(prompt_ids) if len(ids) > 32][:8]  # two full blocks or more
    plain = SamplingParams(temperature=0, max_tokens=1)
    warm = run_requests(engine, {f"warm-{i}": (prompt_ids[i], plain) for i in chosen})
    again = run_requests(engine, {f"again-{i}": (prompt_ids[i], plain) for i in chosen})
    assert all(again[f"again-{i}"].num_cached_tokens >= 32 for i in chosen)  # the blocks are cached
    assert all(warm[f"warm-{i}"].prompt_logprobs is None for i in chosen)
    before = engine.stats["num_prefill_tokens"]
    outputs = run_requests(engine, {f"cached-{i}": (prompt_ids[i], PROMPT_LOGPROBS) for i in chosen})
    for i in chosen:
        check(outputs[f"cached-{i}"], prompt_ids[i], hf_log_softmax[i])
        assert outputs[f"cached-{i}"].num_cached_tokens == 0
    assert engine.stats["num_prefill_tokens"] - before == sum(len(prompt_ids[i]) for i in chosen)
