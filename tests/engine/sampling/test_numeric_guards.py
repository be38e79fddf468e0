"""Every float sampling setting is finite and in its documented range: NaN, +-inf and a value past the
bound are each a SettingError naming the field (issue 39's numeric guards)."""

from __future__ import annotations

import math

import pytest

from batchgen.engine.config import SettingError
from batchgen.engine.sampling.sampling_params import (
    MAX_LENGTH_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    MIN_REPETITION_PENALTY,
    MIN_TEMPERATURE,
    SamplingParams,
)

# field -> values past its documented bounds (besides NaN and +-inf)
OUT_OF_RANGE = {
    "temperature": [-0.01, MAX_TEMPERATURE * 1.01, MIN_TEMPERATURE / 2, 1e-300],
    "top_p": [0.0, 1.01],
    "min_p": [-0.01, 1.01],
    "repetition_penalty": [0.0, -1.0, MIN_REPETITION_PENALTY / 2, MAX_REPETITION_PENALTY * 1.01, 1e308],
    "presence_penalty": [-2.01, 2.01],
    "frequency_penalty": [-2.01, 2.01],
    "length_penalty": [MAX_LENGTH_PENALTY * 1.01, -MAX_LENGTH_PENALTY * 1.01, 1e308, -1e308],
}
BAD = [(name, value) for name, values in OUT_OF_RANGE.items()
       for value in [math.nan, math.inf, -math.inf, *values]]


def test_every_float_field_is_guarded():
    floats = {name for name, kind in SamplingParams.__annotations__.items() if kind == "float"}
    assert floats == set(OUT_OF_RANGE)


@pytest.mark.parametrize("beam_width", [1, 2])
@pytest.mark.parametrize("name, value", BAD, ids=[f"{n}={v!r}" for n, v in BAD])
def test_a_non_finite_or_out_of_range_float_is_refused_by_name(name, value, beam_width):
    base = {"n": 1, "temperature": 0.0} if beam_width > 1 else {}
    with pytest.raises(SettingError, match=rf"^SamplingParams\.{name} ") as info:
        SamplingParams(beam_width=beam_width, **{**base, name: value})
    assert info.value.name == name


@pytest.mark.parametrize("value", [MAX_LENGTH_PENALTY, -MAX_LENGTH_PENALTY, 0.0])
def test_length_penalty_at_its_bounds_is_accepted(value):
    assert SamplingParams(beam_width=2, n=1, temperature=0.0, length_penalty=value).length_penalty == value


@pytest.mark.parametrize("name, value", [
    ("temperature", 0.0), ("temperature", MIN_TEMPERATURE), ("temperature", MAX_TEMPERATURE),
    ("repetition_penalty", MIN_REPETITION_PENALTY), ("repetition_penalty", MAX_REPETITION_PENALTY),
    ("top_p", 1.0), ("min_p", 0.0), ("min_p", 1.0), ("presence_penalty", -2.0), ("frequency_penalty", 2.0),
])
def test_a_float_at_its_bound_is_accepted(name, value):
    assert getattr(SamplingParams(**{name: value}), name) == value


def test_sampling_at_the_extreme_bounds_gives_tokens(llm):
    """The smallest temperature with the largest and smallest repetition penalties: finite logits, a
    sampled token each step (the values just past these would be 0 or inf in float32: NaN)."""
    prompt = {"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7, 8]}
    for penalty in (MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY):
        params = SamplingParams(temperature=MIN_TEMPERATURE, repetition_penalty=penalty, max_tokens=4,
                                ignore_eos=True, seed=0, logprobs=0)
        out = llm.generate([prompt], params)[0].outputs[0]
        assert len(out.token_ids) == 4 and math.isfinite(out.cumulative_logprob)
