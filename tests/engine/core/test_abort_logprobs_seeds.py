"""abort_request frees what a request held; logprobs as vLLM's (None, 0, N); seeded samples keyed by (seed, i)."""

from __future__ import annotations

import pytest
import torch

from batchgen.engine import SamplingParams
from batchgen.engine.config import SettingError
from batchgen.engine.core.sequence import SequenceStatus
from tests.engine.helpers import captured_logits, run_requests
from tests.engine.prompts import CHAT_PROMPTS, LONG_INDEX


def test_abort_frees_running_and_waiting_requests_and_the_rest_finish(llm):
    engine = llm.with_engine_settings(num_kv_blocks=64, max_model_len=512, max_num_seqs=2).engine
    num_free = engine.kv_cache_manager.pool.num_free_blocks
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.add_request("long", CHAT_PROMPTS[LONG_INDEX], params)
    engine.add_request("sampled", CHAT_PROMPTS[1], SamplingParams(temperature=0.8, n=2, seed=3, max_tokens=12))
    engine.add_request("kept", CHAT_PROMPTS[2], params)
    engine.step()
    engine.step()
    long_seq = engine.sequences("long")[0]
    assert long_seq.status == SequenceStatus.RUNNING and long_seq.block_ids
    assert [s.status for s in engine.sequences("kept")] == [SequenceStatus.WAITING]
    num_long_blocks = len(long_seq.block_ids)
    free_before = engine.kv_cache_manager.pool.num_free_blocks

    assert engine.abort_request("long") and engine.abort_request("kept")  # one running, one waiting
    assert engine.kv_cache_manager.pool.num_free_blocks == free_before + num_long_blocks
    assert long_seq.block_ids == [] and long_seq.finish_reason == "abort"
    assert long_seq not in engine.scheduler.running
    assert all(s.request_id != "kept" for s in engine.scheduler.waiting)
    assert not engine.abort_request("long") and not engine.abort_request("never-added")

    outputs = {}
    while engine.has_unfinished():
        outputs.update((o.request_id, o) for o in engine.step())
    assert list(outputs) == ["sampled"] and engine.num_unfinished_requests == 0
    assert engine.kv_cache_manager.pool.num_free_blocks == num_free
    assert all(count == 0 for count in engine.kv_cache_manager.pool.ref_counts)


def test_abort_of_everything_gives_every_block_back(llm):
    engine = llm.with_engine_settings(num_kv_blocks=64, max_model_len=512).engine
    num_free = engine.kv_cache_manager.pool.num_free_blocks
    for i in range(4):
        engine.add_request(f"r{i}", CHAT_PROMPTS[i], SamplingParams(temperature=0, max_tokens=30))
    engine.step()
    assert engine.kv_cache_manager.pool.num_free_blocks < num_free
    for i in range(4):
        engine.abort_request(f"r{i}")
    assert not engine.has_unfinished() and engine.kv_cache_manager.pool.num_free_blocks == num_free


def test_logprobs_spellings_and_range():
    assert SamplingParams(logprobs=True).logprobs == 0 and SamplingParams(logprobs=False).logprobs is None
    assert SamplingParams().logprobs is None and SamplingParams(logprobs=5).logprobs == 5
    with pytest.raises(SettingError, match="logprobs"):
        SamplingParams(logprobs=21)
    with pytest.raises(SettingError, match="logprobs"):
        SamplingParams(logprobs=-1)


def test_top_logprobs_are_the_raw_distributions_top_n(llm):
    prompt = CHAT_PROMPTS[0]
    params = {n: SamplingParams(temperature=0, max_tokens=6, logprobs=n) for n in (None, 0, 3)}
    with captured_logits(llm.engine) as logits:
        outputs = run_requests(llm.engine, {f"lp-{n}": (prompt, p) for n, p in params.items()})
    none, zero, three = (outputs[f"lp-{n}"].outputs[0] for n in (None, 0, 3))
    assert none.token_ids == zero.token_ids == three.token_ids
    assert none.logprobs is None and none.top_logprobs is None
    assert len(zero.logprobs) == 6 and zero.top_logprobs is None
    assert three.logprobs == pytest.approx(zero.logprobs, abs=1e-4)
    assert len(three.top_logprobs) == 6
    for position, (token, chosen, top) in enumerate(zip(three.token_ids, three.logprobs, three.top_logprobs)):
        raw = logits[("lp-3", 0, position)].log_softmax(-1)
        expected = torch.topk(raw, 3)
        assert [t.token_id for t in top] == expected.indices.tolist()
        assert [t.logprob for t in top] == pytest.approx(expected.values.tolist(), abs=1e-4)
        assert [t.token for t in top] == [llm.tokenizer.hf.decode([t.token_id]) for t in top]
        assert top[0].token_id == token and top[0].logprob == pytest.approx(chosen, abs=1e-4)  # greedy


def test_seeded_samples_depend_on_seed_and_index_not_on_the_request(llm):
    prompt = CHAT_PROMPTS[3]
    # Temperature 1: at 0.8 this short greeting ("Hello! How can I assist you today?") is near-certain,
    # and both samples can draw the same 8 tokens.
    params = SamplingParams(temperature=1.0, n=2, seed=42, max_tokens=8)
    first = llm.generate(prompt, params)[0]
    again = llm.generate([CHAT_PROMPTS[0], prompt], params)[1]  # other request ids, other batch
    texts = [c.token_ids for c in first.outputs]
    assert texts == [c.token_ids for c in again.outputs]
    assert texts[0] != texts[1]
    other_seed = llm.generate(prompt, SamplingParams(temperature=0.8, n=2, seed=43, max_tokens=8))[0]
    assert [c.token_ids for c in other_seed.outputs] != texts
    # The engine keys by the request id unless told otherwise: the pipeline's rows stay distinct.
    by_id = run_requests(llm.engine, {"a": (prompt, params), "b": (prompt, params)})
    assert [c.token_ids for c in by_id["a"].outputs] != [c.token_ids for c in by_id["b"].outputs]
    engine = llm.engine
    for request_id in ("x", "y"):
        engine.add_request(request_id, prompt, params, sample_key="")
    keyed = {}
    while engine.has_unfinished():
        keyed.update((o.request_id, o) for o in engine.step())
    assert [c.token_ids for c in keyed["x"].outputs] == [c.token_ids for c in keyed["y"].outputs] == texts
