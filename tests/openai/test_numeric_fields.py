"""A JSON body whose float sampling field is past its range (1e308, -1e308, 1e309 which JSON reads as
inf) is a 400 naming that field, from parsing to SamplingParams, before anything reaches the engine
(issue 39: `length_penalty: 1e308` with beam search used to fail the whole step)."""

from __future__ import annotations

import json

import pytest

from batchgen.openai.api_error import APIError
from batchgen.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
    sampling_params_from_body,
)

FIELDS = ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
          "length_penalty"]
BODIES = {
    CompletionRequest: {"prompt": "hello", "max_tokens": 4},
    ChatCompletionRequest: {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4},
}


def to_params(model, body: dict):
    return sampling_params_from_body(parse_request(json.dumps(body), model))


@pytest.mark.parametrize("model", list(BODIES), ids=lambda m: m.__name__)
@pytest.mark.parametrize("literal", ["1e308", "-1e308", "1e309", "-1e309"])
@pytest.mark.parametrize("name", FIELDS)
def test_a_huge_float_is_a_400_naming_its_field(model, name, literal):
    body = dict(BODIES[model])
    if name == "length_penalty":
        body.update(use_beam_search=True, n=2)
    text = json.dumps(body)[:-1] + f', "{name}": {literal}}}'
    with pytest.raises(APIError) as info:
        sampling_params_from_body(parse_request(text, model))
    assert info.value.status == 400 and info.value.param == name, info.value.message


@pytest.mark.parametrize("value", [10.0, -10.0])
def test_beam_search_length_penalty_at_its_bounds_is_accepted(value):
    body = {**BODIES[CompletionRequest], "use_beam_search": True, "n": 2, "length_penalty": value}
    params = to_params(CompletionRequest, body)
    assert params.beam_width == 2 and params.length_penalty == value
