"""vLLM's stop rules on the real model: a stop string counts only when it ends in text made after
min_tokens tokens; the text is the decoded output tokens cut at the stop, or kept with
include_stop_str_in_output; a stop token's text is left out unless include_stop_str_in_output.

The reference is vLLM's documented rule applied, token by token, to a greedy baseline decoded by
transformers' tokenizer (get_tokenizer()), not the engine's incremental text.
"""

from __future__ import annotations

import pytest

from batchgen.engine import SamplingParams
from tests.engine.prompts import chat

PROMPT = "Write three short lines about the sea:\n"  # greedy: "\nThe sea is a vast and mysterious realm, ..."
MAX_TOKENS = 16


def vllm_stop(hf, token_ids: list[int], stops: list[str], min_tokens: int, include: bool):
    """(tokens kept, text, stop) where vLLM's rule stops `token_ids`; None when it runs through.

    After each token past min_tokens, only the text that token added is searched (a stop string may
    begin up to len(stop) - 1 characters before it); the text of the first min_tokens tokens never is.
    """
    checked = hf.decode(token_ids[:min_tokens])
    for k in range(min_tokens + 1, len(token_ids) + 1):
        text = hf.decode(token_ids[:k])
        hits = [(i, s) for s in stops if (i := text.find(s, max(0, len(checked) - len(s) + 1))) >= 0]
        if hits:
            i, stop = min(hits)
            return k, text[:i + len(stop) if include else i], stop
        checked = text
    return None


@pytest.fixture(scope="module")
def baseline(llm) -> list[int]:
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0].outputs[0]
    assert out.finish_reason == "length"
    return out.token_ids


def generate(llm, **params):
    return llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, **params))[0].outputs[0]


def test_a_stop_string_inside_the_first_min_tokens_does_not_cut_the_text(llm, baseline):
    hf = llm.get_tokenizer()
    assert hf.decode(baseline[:1]) == "\n"  # the stop string is the very first token's text
    out = generate(llm, stop=["\n"], min_tokens=3)
    # No newline after the first 3 tokens within 16: the sample runs to its length, its text whole.
    assert vllm_stop(hf, baseline, ["\n"], 3, include=False) is None
    assert out.finish_reason == "length" and out.token_ids == baseline
    assert out.text == hf.decode(out.token_ids) and out.text.startswith("\nThe sea")
    # Without min_tokens the same stop ends it at once, with nothing before the stop.
    first = generate(llm, stop=["\n"])
    assert (first.token_ids, first.text, first.stop_reason) == (baseline[:1], "", "\n")


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_after_min_tokens_cuts_the_decoded_tokens(llm, baseline, include):
    hf = llm.get_tokenizer()
    stops, min_tokens = ["e"], 3  # "The" and " sea" (tokens 2-3) hold it; later tokens too
    assert "e" in hf.decode(baseline[:min_tokens])
    expected = vllm_stop(hf, baseline, stops, min_tokens, include)
    assert expected is not None and expected[0] > min_tokens
    num_tokens, text, stop = expected
    out = generate(llm, stop=stops, min_tokens=min_tokens, include_stop_str_in_output=include)
    assert out.token_ids == baseline[:num_tokens]
    assert out.text == text and out.text  # non-empty, the decoded tokens up to the cut
    assert out.text == hf.decode(out.token_ids)[:len(out.text)]
    assert out.text.endswith("e") == include
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)


def test_a_stop_token_is_left_out_of_the_text_unless_asked_for(llm, baseline):
    hf = llm.get_tokenizer()
    stop_token = baseline[5]  # " vast": an ordinary token
    assert stop_token not in baseline[:5]
    left_out = generate(llm, stop_token_ids=[stop_token])
    kept = generate(llm, stop_token_ids=[stop_token], include_stop_str_in_output=True)
    assert left_out.token_ids == kept.token_ids == baseline[:6]  # the token ids always hold it
    assert left_out.text == hf.decode(baseline[:5])
    assert kept.text == hf.decode(baseline[:6])
    assert left_out.stop_reason == kept.stop_reason == stop_token

    # EOS too, when special tokens are decoded.
    params = {"temperature": 0, "max_tokens": 32, "skip_special_tokens": False}
    short = llm.chat(chat("What is the capital of France?"), SamplingParams(**params))[0].outputs[0]
    with_eos = llm.chat(chat("What is the capital of France?"),
                        SamplingParams(**params, include_stop_str_in_output=True))[0].outputs[0]
    assert short.finish_reason == "stop" and short.token_ids[-1] in llm.engine.eos_token_ids
    assert short.text == hf.decode(short.token_ids[:-1])
    assert with_eos.text == hf.decode(with_eos.token_ids) and with_eos.text.endswith(hf.decode(short.token_ids[-1:]))
