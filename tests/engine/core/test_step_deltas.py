"""What step() returns per request on the bundled model: a DELTA request's outputs, one per step it
advanced, join into its FINAL_ONLY output (n = 2 seeded samples, logprobs with top-2, prompt
log-probabilities, a stop string), in order and with steps launched ahead."""

from __future__ import annotations

import copy

import pytest

from batchgen.engine import RequestOutputKind, SamplingParams
from tests.engine.prompts import chat

PROMPT = chat("Write a short story about a robot who learns to paint.")
PARAMS = dict(n=2, temperature=0.8, seed=7, max_tokens=24, logprobs=2, prompt_logprobs=1)


def outputs_of(engine, request_id: str, params: SamplingParams) -> list:
    """Every output step() returned for the request; its samples keyed by one sample key, so any request
    id gives the same samples."""
    engine.add_request(request_id, PROMPT, params, sample_key="k")
    outputs = []
    while engine.has_unfinished():
        outputs += [o for o in engine.step() if o.request_id == request_id]
    return outputs


def fields(out) -> list:
    return [(c.index, c.text, c.token_ids, c.logprobs, c.top_logprobs, c.finish_reason, c.stop_reason)
            for c in out.outputs]


@pytest.fixture(scope="module")
def stop_word(llm):
    [probe] = outputs_of(llm.engine, "probe", SamplingParams(**PARAMS))
    return probe.outputs[0].text.split()[4]  # ends sample 0 part way


@pytest.mark.parametrize("is_async", [False, True])
def test_delta_outputs_join_into_the_final_output(llm, stop_word, is_async):
    engine = llm.with_engine_settings(async_scheduling=is_async).engine
    [whole] = outputs_of(engine, "final", SamplingParams(**PARAMS, stop=[stop_word]))
    assert whole.outputs[0].stop_reason == stop_word  # the stop string ended sample 0
    deltas = outputs_of(engine, "delta", SamplingParams(**PARAMS, stop=[stop_word],
                                                        output_kind=RequestOutputKind.DELTA))
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert len(deltas) == max(len(c.token_ids) for c in whole.outputs)  # one per step that read back tokens
    assert deltas[0].prompt_logprobs == whole.prompt_logprobs and deltas[1].prompt_logprobs is None
    joined = copy.deepcopy(deltas[0])
    for delta in deltas[1:]:
        joined.add(delta)
    assert fields(joined) == fields(whole)
    assert joined.prompt_logprobs == whole.prompt_logprobs and joined.num_cached_tokens == whole.num_cached_tokens
    for index, final in enumerate(whole.outputs):  # what was sent before the end is never cut away
        sent = "".join(c.text for d in deltas for c in d.outputs if c.index == index and c.finish_reason is None)
        assert final.text.startswith(sent) and sent
    assert not engine.has_unfinished() and engine.kv_cache_manager.pool.num_free_blocks == engine.num_kv_blocks
