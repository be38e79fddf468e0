"""Async scheduling: step N+1 is scheduled, packed and launched before step N's tokens are read back.

Every test compares an engine that launches a step ahead (async_scheduling forced on the CPU) with one
that steps in order over the same weights: every request's tokens, finish and stop reasons, text and
log-probabilities must agree.
- A tiny random-weight Llama (peaked logits: few near-ties): greedy, seeded samples (n=2, top-k/top-p,
  logprobs), penalties, min_tokens, a stop token, a stop string, max_tokens and max_model_len caps,
  over a KV pool small enough to preempt, with chunked prefills and shared prefixes in the prefix
  cache; an abort with a step in flight; what a streaming caller sees; the prefix cache after pending
  tokens; a stand-in GPU (device_stream.ThreadStream) on which the host prepares the next step while
  the "device" runs; Triton attention with decode graphs, whose capture waits in order for the FP8 KV
  scales.
- The bundled model: a batch mixing plain requests with ones that need each step's results on the
  host (a JSON schema, a choice list, prompt log-probabilities, a beam search), added while steps run
  ahead: the engine collects the step in flight and runs those steps in order, then runs ahead again.
"""

from __future__ import annotations

import pytest

from batchgen.bench import structured_quality as quality
from batchgen.engine import LLMEngine, RequestOutputKind, SamplingParams
from batchgen.engine.config import EngineConfig
from batchgen.engine.runner.decode_graphs import EagerCapturer
from batchgen.engine.runner.device_stream import ThreadStream
from tests.engine.helpers import run_requests
from tests.engine.prompts import CHAT_PROMPTS
from tests.pipeline.tiny_model import write_tiny_model

SHAPE = dict(hidden=64, intermediate=128, num_layers=2, num_heads=4, num_kv_heads=2)
ENGINE = dict(dtype="float32", device="cpu", max_model_len=96, block_size=16, num_kv_blocks=14,
              max_num_seqs=8, max_num_batched_tokens=40)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, llm):
    # The session engine's tokenizer is already loaded: the tiny model reuses it.
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", llm.engine.tokenizer.hf,
                            weight_std=0.3, vocab_size=512, **SHAPE)


@pytest.fixture(scope="module")
def tiny_in_order(tiny_folder):
    return LLMEngine(EngineConfig(model=str(tiny_folder), async_scheduling=False, **ENGINE))


def tiny_engine(base: LLMEngine, is_async: bool, **changes) -> LLMEngine:
    """A fresh pool, scheduler and runner over `base`'s weights."""
    return LLMEngine(base.config.replace(async_scheduling=is_async, **changes), weights_from=base)


def requests(stop_token: int, stop_string: str) -> dict[str, tuple[list[int], SamplingParams]]:
    shared = [(5 * j) % 500 + 3 for j in range(20)]  # a prefix-cache hit for the later prompts
    prompts = [shared + [i + 7] * (3 + i) for i in range(6)]
    prompts += [[(11 * j + i) % 500 + 3 for j in range(9 + 4 * i)] for i in range(4)]
    kinds = [SamplingParams(temperature=0, max_tokens=14),
             SamplingParams(temperature=0.9, top_k=40, top_p=0.9, n=2, seed=5, max_tokens=10, logprobs=2),
             SamplingParams(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5, seed=1,
                            max_tokens=12),
             SamplingParams(temperature=0, max_tokens=16, min_tokens=4, stop_token_ids=[stop_token]),
             SamplingParams(temperature=0.8, max_tokens=20, stop_token_ids=[stop_token], seed=2),
             SamplingParams(temperature=0, max_tokens=24, stop=[stop_string], logprobs=0)]
    reqs = {f"r{i}": (prompt, kinds[i % len(kinds)]) for i, prompt in enumerate(prompts)}
    # Capped by max_model_len (96) before max_tokens.
    reqs["long"] = ([(7 * j) % 500 + 3 for j in range(84)], SamplingParams(temperature=0, max_tokens=40,
                                                                           ignore_eos=True))
    return reqs


def outputs_of(engine: LLMEngine, reqs) -> dict:
    outs = run_requests(engine, reqs)
    return {rid: [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs, c.cumulative_logprob)
                  for c in out.outputs] for rid, out in outs.items()}


def assert_same_outputs(expected: dict, got: dict) -> None:
    assert set(got) == set(expected)
    for rid, samples in expected.items():
        assert len(got[rid]) == len(samples), rid
        for (tokens, text, reason, stop, logprobs, cumulative), (tokens2, text2, reason2, stop2, logprobs2,
                                                                 cumulative2) in zip(samples, got[rid]):
            assert (tokens2, text2, reason2, stop2) == (tokens, text, reason, stop), rid
            if logprobs:
                assert logprobs2 == pytest.approx(logprobs, rel=1e-4, abs=1e-5), rid
            else:
                assert logprobs2 == logprobs, rid
            assert cumulative2 == pytest.approx(cumulative, rel=1e-4, abs=1e-5), rid


def test_async_engine_gives_the_in_order_engines_outputs(tiny_in_order):
    in_order = tiny_in_order
    ahead = tiny_engine(in_order, True)
    assert ahead.is_async and not in_order.is_async
    # r3 (greedy, min_tokens 4) meets its stop token: the first of its tokens past the fourth that it has
    # not emitted before; r5 (greedy) its stop string: the text of its fifth and sixth tokens.
    base = requests(0, "x")
    probe = run_requests(in_order, {"p3": (base["r3"][0], SamplingParams(temperature=0, max_tokens=16)),
                                    "p5": (base["r5"][0], SamplingParams(temperature=0, max_tokens=24))})
    tokens = probe["p3"].outputs[0].token_ids
    stop_token = next(t for i, t in enumerate(tokens) if i >= 4 and t not in tokens[:i])
    p5 = probe["p5"].outputs[0].token_ids
    stop_string = in_order.tokenizer.decode(p5[4:6])
    reqs = requests(stop_token, stop_string)
    feeds = []
    feed = ahead.runner._feed
    ahead.runner._feed = lambda step, prev: feeds.append("f.feed_rows" in step.tensors) or feed(step, prev)
    expected, got = outputs_of(in_order, reqs), outputs_of(ahead, reqs)
    assert_same_outputs(expected, got)
    reasons = {(c[2], type(c[3])) for outs in expected.values() for c in outs}
    assert {("stop", int), ("stop", str), ("length", type(None))} <= reasons  # every way of finishing was met
    assert len(got["long"][0][0]) == 96 - 84  # the context limit, not max_tokens
    assert sum(feeds) > 10  # most decode steps read their input tokens on the device
    assert ahead.scheduler.stats.num_preemptions > 0 and in_order.scheduler.stats.num_preemptions > 0
    assert not ahead.has_unfinished() and ahead.kv_cache_manager.pool.num_free_blocks == 14


def test_abort_with_a_step_in_flight_drops_its_rows(tiny_in_order):
    engine = tiny_engine(tiny_in_order, True)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request("a", [3, 4, 5, 6], params)
    engine.add_request("b", [7, 8, 9], params)
    engine.step()  # the prefill in flight
    engine.step()  # a decode launched, the prefill's tokens read back
    assert engine.in_flight is not None
    assert engine.abort_request("a")
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert [o.request_id for o in outputs] == ["b"] and len(outputs[0].outputs[0].token_ids) == 8
    assert engine.kv_cache_manager.pool.num_free_blocks == 14


def test_a_streaming_caller_sees_only_tokens_read_back(tiny_in_order):
    """A DELTA request's outputs (what the server streams) carry the tokens read back so far: joined they
    are a prefix of the final output after every step, while its pending token is counted in
    num_output_tokens."""
    engine = tiny_engine(tiny_in_order, True)
    engine.add_request("s", [5, 6, 7], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                      output_kind=RequestOutputKind.DELTA))
    seq = engine.sequences("s")[0]
    joined, seen = [], []
    while engine.has_unfinished():
        for out in engine.step():
            joined += out.outputs[0].token_ids
        seen.append((list(joined), seq.num_output_tokens))
    final = run_requests(tiny_engine(tiny_in_order, True), {"s": ([5, 6, 7], SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True))})["s"].outputs[0].token_ids
    assert joined == final and len(final) == 8
    assert all(final[:len(ids)] == ids for ids, _ in seen)
    assert any(count == len(ids) + 1 for ids, count in seen)  # a token pending on the device, not shown


def test_a_length_capped_sequence_is_not_scheduled_past_its_last_token(tiny_in_order):
    """Its last token still in flight, a sequence at max_tokens gets no further row: the async engine
    computes exactly the decode tokens of the in-order one."""
    decode_tokens = {}
    for is_async in (False, True):
        engine = tiny_engine(tiny_in_order, is_async)
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        out = run_requests(engine, {"a": ([3, 4, 5], params), "b": ([9, 8, 7, 6], params)})
        assert [len(o.outputs[0].token_ids) for o in out.values()] == [6, 6]
        decode_tokens[is_async] = engine.scheduler.stats.num_decode_tokens
    assert decode_tokens[True] == decode_tokens[False] == 2 * 5


def test_blocks_filled_by_pending_tokens_enter_the_prefix_cache_under_their_real_ids(tiny_in_order):
    """A block a pending token completes is registered once the token is known: a request repeating a
    finished one's prompt and output finds every full block of it cached, as after in-order steps.
    Token 31, the second block's last, is the one before the last sampled: the step that computes it is
    the sequence's last, so only its read-back can register that block."""
    cached = {}
    for is_async in (False, True):
        engine = tiny_engine(tiny_in_order, is_async)
        params = SamplingParams(temperature=0, max_tokens=28, ignore_eos=True)
        first = run_requests(engine, {"a": ([3, 4, 5, 6, 7], params)})["a"]
        again = [3, 4, 5, 6, 7] + first.outputs[0].token_ids  # 33 tokens, 32 of them computed: 2 full blocks
        second = run_requests(engine, {"b": (again + [9], SamplingParams(temperature=0, max_tokens=1))})["b"]
        cached[is_async] = second.num_cached_tokens
    assert cached == {False: 32, True: 32}


def test_on_a_stand_in_gpu_the_next_step_is_queued_before_this_one_ends(tiny_in_order):
    """The device work on a thread of its own, 20 ms a step: the host packs the next step into the other
    buffer while the device still reads this one's, and the outputs stay the in-order engine's."""
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=3, n=2, max_tokens=10, logprobs=1)]
    reqs = {f"q{i}": ([i + 3] * (5 + i), params[i % 2]) for i in range(4)}
    expected = outputs_of(tiny_engine(tiny_in_order, False), reqs)
    engine = tiny_engine(tiny_in_order, True)
    engine.runner.stream = stream = ThreadStream(0.02)
    try:
        got = outputs_of(engine, reqs)
    finally:
        stream.close()
    assert_same_outputs(expected, got)
    gaps = stream.idle_gaps()
    assert sum(gap == 0 for gap in gaps) >= len(gaps) // 2, gaps  # queued before the previous step ended


@pytest.mark.triton
def test_decode_graphs_replay_the_fed_tokens_and_wait_in_order_for_the_fp8_kv_scales(tiny_in_order):
    """Triton attention (the interpreter) with decode graphs (an eager stand-in for the capture): the graphs
    read the pending tokens the device fed into the step. With calculate_kv_scales the capture waits for
    the first step, which runs in order; then steps launch ahead and replay the graphs."""
    settings = dict(kv_cache_dtype="fp8", calculate_kv_scales=True, attention_backend="triton",
                    max_num_seqs=4)
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=4, max_tokens=6, ignore_eos=True)]
    reqs = {f"g{i}": ([3 + i, 9, 27, 4 + i][:2 + i], params[i % 2]) for i in range(3)}
    triton = LLMEngine(tiny_in_order.config.replace(**settings))  # the backend is chosen at load
    results, kinds = {}, []
    for is_async in (False, True):
        engine = tiny_engine(triton, is_async)
        capturer = EagerCapturer()
        engine.runner.capture_decode_graphs(96, capturer=capturer)
        assert engine.runner.is_capture_pending
        executor = engine.executor
        launch, execute = executor.launch, executor.execute
        executor.launch = lambda *args: kinds.append("ahead") or launch(*args)
        executor.execute = lambda *args: kinds.append("in order") or execute(*args)
        results[is_async] = outputs_of(engine, reqs)
        assert capturer.num_replays >= 4, capturer.num_replays  # the decode steps replayed a graph
    assert_same_outputs(results[False], results[True])
    async_kinds = kinds[kinds.index("ahead") - 1:]
    assert async_kinds[0] == "in order" and set(async_kinds[1:]) == {"ahead"}, kinds


# ---- the bundled model: requests that need the host between steps, among plain ones ----------------

def mixed_requests() -> tuple[dict, dict]:
    """Plain requests (added first), then requests whose steps need the host (added while they run)."""
    plain = {
        "greedy-0": (CHAT_PROMPTS[0], SamplingParams(temperature=0, max_tokens=40)),
        "greedy-1": (CHAT_PROMPTS[1], SamplingParams(temperature=0, max_tokens=40, stop=[".", "!", "?"])),
        "sampled": (CHAT_PROMPTS[2], SamplingParams(temperature=0.8, top_p=0.9, seed=7, n=2, max_tokens=36,
                                                    logprobs=2)),
    }
    host_bound = {
        "json": (quality.chat_prompts()[0], SamplingParams(temperature=0, max_tokens=24,
                                                           structured_outputs={"json": quality.PERSON})),
        "choice": (CHAT_PROMPTS[3], SamplingParams(temperature=0, max_tokens=6,
                                                   structured_outputs={"choice": ["yes", "no", "maybe"]})),
        "prompt-logprobs": (CHAT_PROMPTS[4], SamplingParams(temperature=0, max_tokens=10, prompt_logprobs=2)),
        "beam": (CHAT_PROMPTS[5], SamplingParams(beam_width=2, n=2, temperature=0, max_tokens=8)),
    }
    return plain, host_bound


def run_mixed(engine: LLMEngine) -> dict:
    plain, host_bound = mixed_requests()
    for rid, (prompt, params) in plain.items():
        engine.add_request(rid, prompt, params)
    outputs = {}
    for _ in range(3):
        outputs.update({o.request_id: o for o in engine.step()})
    for rid, (prompt, params) in host_bound.items():
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished():
        outputs.update({o.request_id: o for o in engine.step()})
    assert set(outputs) == set(plain) | set(host_bound)
    return outputs


def test_a_mixed_batch_with_constrained_beam_and_prompt_logprob_requests(llm):
    """Steps run ahead until the host-bound requests arrive, in order while any of them is unfinished,
    then ahead again; every output equals the in-order engine's."""
    settings = dict(max_model_len=512, enable_prefix_caching=False)
    in_order = llm.with_engine_settings(async_scheduling=False, **settings).engine
    ahead = llm.with_engine_settings(async_scheduling=True, **settings).engine
    kinds = []
    executor = ahead.executor
    launch, execute = executor.launch, executor.execute
    executor.launch = lambda *args: kinds.append("ahead") or launch(*args)
    executor.execute = lambda *args: kinds.append("in order") or execute(*args)
    expected, got = run_mixed(in_order), run_mixed(ahead)
    for rid, out in expected.items():
        other = got[rid]
        assert len(other.outputs) == len(out.outputs), rid
        for a, b in zip(out.outputs, other.outputs):
            assert b.token_ids == a.token_ids and b.text == a.text, rid
            assert (b.finish_reason, b.stop_reason) == (a.finish_reason, a.stop_reason), rid
            assert b.cumulative_logprob == pytest.approx(a.cumulative_logprob, rel=1e-4, abs=1e-4), rid
            if a.logprobs:
                assert b.logprobs == pytest.approx(a.logprobs, rel=1e-4, abs=1e-4), rid
            else:
                assert b.logprobs is None, rid
            assert b.score == pytest.approx(a.score, rel=1e-4) if a.score is not None else b.score is None
        if out.prompt_logprobs is not None:
            assert len(other.prompt_logprobs) == len(out.prompt_logprobs)
            for x, y in zip(out.prompt_logprobs[1:], other.prompt_logprobs[1:]):
                assert list(y) == list(x)
                expected = [v.logprob for v in x.values()]
                assert [v.logprob for v in y.values()] == pytest.approx(expected, abs=1e-4)
    assert got["greedy-1"].outputs[0].finish_reason == "stop"  # its stop string met
    assert got["json"].outputs[0].text.startswith("{")
    assert got["choice"].outputs[0].text in ("yes", "no", "maybe")
    assert got["prompt-logprobs"].prompt_logprobs is not None and len(got["beam"].outputs) == 2
    # Ahead, then in order from the host-bound requests' arrival, then ahead again once they finished.
    runs = [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]
    assert runs == ["ahead", "in order", "ahead"], kinds
    assert not ahead.has_unfinished() and not ahead.in_order_requests
