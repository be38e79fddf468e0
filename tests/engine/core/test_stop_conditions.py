"""Stop strings, stop token ids, EOS, min_tokens, max_tokens and ignore_eos on the real model.

A greedy baseline fixes what the model says; each variant is then checked against it: greedy
decoding is deterministic, so a variant must follow the baseline token for token until its own
stopping rule acts.
"""

from __future__ import annotations

import pytest

from batchgen.engine import SamplingParams
from tests.engine.helpers import run_requests
from tests.engine.prompts import chat

# Answers in a few tokens then EOS; talks on for a long time.
SHORT_ANSWER = chat("What is the capital of France?")
LONG_ANSWER = chat("Write a short story about a robot who learns to paint.")


@pytest.fixture(scope="module")
def baseline(llm):
    params = SamplingParams(temperature=0, max_tokens=40)
    outputs = run_requests(llm.engine, {"short": (SHORT_ANSWER, params), "long": (LONG_ANSWER, params)})
    short, long = outputs["short"].outputs[0], outputs["long"].outputs[0]
    assert short.finish_reason == "stop" and short.token_ids[-1] in llm.engine.eos_token_ids
    assert long.finish_reason == "length" and len(long.token_ids) == 40
    return short, long


def test_stop_strings_end_the_text_before_the_earliest_stop(llm, baseline):
    _, long = baseline
    words = long.text.split()
    first, later = words[3], words[8]  # the earliest occurrence of either wins
    assert long.text.find(first) < long.text.find(later)
    params = SamplingParams(temperature=0, max_tokens=40, stop=[later, first])
    out = run_requests(llm.engine, {"stop": (LONG_ANSWER, params)})["stop"].outputs[0]
    assert out.text == long.text[:long.text.find(first)]
    assert first not in out.text
    assert out.finish_reason == "stop" and out.stop_reason == first
    # Generation stopped at the token that completed the stop string, not later.
    num_tokens = len(out.token_ids)
    assert out.token_ids == long.token_ids[:num_tokens]
    assert first in llm.tokenizer.decode(long.token_ids[:num_tokens])
    assert first not in llm.tokenizer.decode(long.token_ids[:num_tokens - 1])


def test_stop_token_ids_min_max_tokens_and_ignore_eos(llm, baseline):
    short, long = baseline
    eos_index = len(short.token_ids) - 1
    # A stop token: the first token of the long answer that did not occur before it (after a few).
    stop_index = next(i for i in range(3, 40) if long.token_ids[i] not in long.token_ids[:i])
    stop_token = long.token_ids[stop_index]
    requests = {
        "stop_id": (LONG_ANSWER, SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_token])),
        "max": (LONG_ANSWER, SamplingParams(temperature=0, max_tokens=5)),
        "min": (SHORT_ANSWER, SamplingParams(temperature=0, max_tokens=40, min_tokens=eos_index + 6)),
        "ignore_eos": (SHORT_ANSWER, SamplingParams(temperature=0, max_tokens=eos_index + 6, ignore_eos=True)),
    }
    outputs = {rid: out.outputs[0] for rid, out in run_requests(llm.engine, requests).items()}

    stop_id = outputs["stop_id"]
    assert stop_id.token_ids == long.token_ids[:stop_index + 1]
    assert stop_id.finish_reason == "stop" and stop_id.stop_reason == stop_token

    assert outputs["max"].token_ids == long.token_ids[:5] and outputs["max"].finish_reason == "length"

    eos = set(llm.engine.eos_token_ids)
    at_least = outputs["min"]
    assert len(at_least.token_ids) >= eos_index + 6
    assert not eos & set(at_least.token_ids[:eos_index + 6])  # EOS banned until min_tokens
    assert at_least.token_ids[:eos_index] == short.token_ids[:eos_index]

    ignored = outputs["ignore_eos"]
    assert len(ignored.token_ids) == eos_index + 6 and ignored.finish_reason == "length"
    assert ignored.token_ids[:eos_index + 1] == short.token_ids  # EOS is emitted, and generation goes on


def test_generation_stops_at_max_model_len(llm):
    short_context = llm.with_engine_settings(max_model_len=64)
    prompt = list(range(1000, 1060))  # 60 tokens: room for 4 more
    out = run_requests(short_context.engine, {"ctx": (prompt, SamplingParams(temperature=0, max_tokens=10,
                                                                              ignore_eos=True))})["ctx"]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len"):
        short_context.engine.add_request("too-long", list(range(1000, 1064)), SamplingParams())
