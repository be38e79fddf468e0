"""Structured output through the engine on the bundled model: outputs satisfy their constraint (checked
by the `jsonschema` package, `re` and membership), unconstrained ones do not; grammar end -> stop,
max_tokens -> length; a seeded constrained sample alone equals itself among 32 mixed rows; speculative
decoding (drafts cut by the grammar, verify rows masked) changes no output; bad constraints are
refused before anything is queued. The full 200-prompt run is bench/structured_quality.py (its
figures are in docs/benchmarks/history/structured-output.md); here a smaller batch of the same requests.
"""

from __future__ import annotations

import json
import math

import jsonschema
import pytest

from batchgen.bench import structured_quality as quality
from batchgen.engine import LLM, SamplingParams
from batchgen.engine.config import SettingError
from batchgen.engine.decoding.structured import (
    GuidedDecodingParams,
    StructuredOutputError,
    StructuredOutputsParams,
)
from tests.engine.helpers import run_requests
from tests.engine.prompts import CHAT_PROMPTS

PERSON = quality.PERSON
TICKET = quality.TICKET


@pytest.fixture(scope="module")
def engine(llm):
    """A fresh pool and counters over the session's weights (the compiler is shared with it)."""
    return llm.with_engine_settings(max_num_seqs=128).engine


def test_constrained_outputs_validate_and_the_same_prompts_unconstrained_do_not(engine):
    """5 chat prompts x (the 5 schemas, the same prompts unconstrained, a date regex, a choice list),
    greedy and sampled at T 0.8, all 40 requests in one batch."""
    prompts = quality.chat_prompts()
    requests = [r for temperature in (0.0, 0.8)
                for r in quality.build_requests(prompts, 5, temperature, max_tokens=80, seed=3)]
    for r in requests:  # the temperatures' ids differ: make them distinct within the batch
        r.request_id = f"{r.request_id}-{r.params.temperature}"
    before = engine.stats["structured"]
    results = quality.run_requests(engine, requests)["results"]
    for kind in ("schema", "regex", "choice"):
        r = results[kind]
        assert r.num_valid_stop == r.num_stop, (kind, r.invalid_examples)
        assert r.num_stop >= 0.8 * r.num_requests, (kind, r.as_dict())  # most finish: the check means something
    free = results["unconstrained"]
    assert free.num_valid_stop <= 0.1 * free.num_requests, free.as_dict()
    after = engine.stats["structured"]
    assert after["num_constrained_requests"] - before["num_constrained_requests"] == 30
    assert after["num_masked_steps"] > before["num_masked_steps"] and after["mask_ms_per_step"] > 0


def test_grammar_end_is_stop_and_max_tokens_mid_object_is_length(engine):
    params = SamplingParams(temperature=0, max_tokens=64, logprobs=2, structured_outputs={"json": PERSON})
    short = SamplingParams(temperature=0, max_tokens=6, structured_outputs={"json": PERSON})
    outputs = run_requests(engine, {"whole": (quality.chat_prompts()[0], params),
                                    "cut": (quality.chat_prompts()[0], short)})
    whole, cut = outputs["whole"].outputs[0], outputs["cut"].outputs[0]
    assert whole.finish_reason == "stop" and whole.stop_reason is None
    assert whole.token_ids[-1] in engine.eos_token_ids  # the grammar's end allows only EOS
    jsonschema.validate(json.loads(whole.text), PERSON)
    # Logprobs are of the constrained distribution: the EOS the complete grammar forces has probability 1.
    assert whole.logprobs[-1] == 0.0 and all(math.isfinite(lp) and lp <= 0 for lp in whole.logprobs)
    assert whole.top_logprobs[-1][0].token_id == whole.token_ids[-1] and whole.top_logprobs[-1][1].logprob == -math.inf
    assert cut.finish_reason == "length" and len(cut.token_ids) == 6
    assert cut.token_ids == whole.token_ids[:6]  # the same greedy walk, cut
    with pytest.raises(ValueError):
        json.loads(cut.text)


def test_a_seeded_constrained_sample_alone_equals_it_among_32_mixed_rows(llm):
    """Tokens of two constrained requests (sampled T 0.8 seeded with n = 2, and greedy), each alone in
    the engine, then among 29 others (32 rows): constrained (other schemas, a regex) and unconstrained,
    sampled and greedy, of other lengths (so the batch changes under them)."""
    prompts = list(CHAT_PROMPTS)
    sampled = SamplingParams(temperature=0.8, seed=11, n=2, max_tokens=32, structured_outputs={"json": TICKET})
    greedy = SamplingParams(temperature=0, max_tokens=32, structured_outputs={"json": PERSON})
    watched = {"sampled": (prompts[0], sampled), "greedy": (prompts[1], greedy)}
    engine = llm.with_engine_settings(max_num_seqs=64).engine
    alone = {}
    for request_id, request in watched.items():
        alone.update(run_requests(engine, {request_id: request}))
    others = {}
    kinds = [{"json": PERSON}, {"json": quality.KEYWORDS}, {"regex": quality.DATE_REGEX}, None]
    for i in range(29):
        constraint = kinds[i % 4]
        temperature = 0.8 if i % 3 else 0.0
        others[f"other-{i}"] = (prompts[2 + i % (len(prompts) - 2)],
                                SamplingParams(temperature=temperature, seed=i, max_tokens=8 + i,
                                               structured_outputs=constraint))
    together = run_requests(engine, {**others, **watched})
    for request_id in watched:
        assert [c.token_ids for c in together[request_id].outputs] == \
            [c.token_ids for c in alone[request_id].outputs], request_id
    assert engine.stats["structured"]["masked_rows_per_step"] > 4  # the mates were constrained too


@pytest.mark.parametrize("spec", [{"method": "ngram"},
                                  {"method": "draft_model", "model": "smollm2-135m-instruct"}],
                         ids=["ngram", "self-draft"])
def test_speculative_decoding_changes_no_constrained_output(llm, spec):
    """Drafts are cut to what the grammar allows and each verify row is masked as plain decoding
    would mask it: the tokens equal speculation off's, greedy and seeded."""
    requests = {}
    for i, name in enumerate(["person", "ticket"]):
        instruction, schema = quality.SCHEMAS[name]
        messages = [{"role": "system", "content": instruction}, *CHAT_PROMPTS[i]]
        requests[f"greedy-{i}"] = (messages, SamplingParams(temperature=0, max_tokens=32,
                                                            structured_outputs={"json": schema}))
        requests[f"sampled-{i}"] = (messages, SamplingParams(temperature=0.8, seed=i, max_tokens=32,
                                                             structured_outputs={"json": schema}))
    off = run_requests(llm.with_engine_settings(max_num_seqs=8).engine, requests)
    engine = llm.with_engine_settings(max_num_seqs=8, speculative={**spec, "disable_by_batch_size": 8}).engine
    on = run_requests(engine, requests)
    assert {k: o.outputs[0].token_ids for k, o in on.items()} == {k: o.outputs[0].token_ids for k, o in off.items()}
    stats = engine.stats["speculative"]
    assert stats["num_draft_tokens"] > 0 and stats["num_accepted_tokens"] > 0


def test_bad_constraints_are_refused_naming_the_field_and_nothing_is_queued(engine):
    prompt = CHAT_PROMPTS[0]
    cases = [
        ({"json": {"type": "object", "properties": {"a": {"type": "string", "minLength": 5, "maxLength": 2}},
                   "required": ["a"]}}, "json"),  # unsatisfiable
        ({"json": {"type": "strin"}}, "json"),
        ({"regex": "[a-z"}, "regex"),
        ({"regex": "[^\\s\\S]"}, "regex"),  # parses, matches nothing
        ({"grammar": "start: foo"}, "grammar"),
    ]
    for constraint, field_name in cases:
        with pytest.raises(StructuredOutputError) as info:
            engine.add_request("bad", prompt, SamplingParams(max_tokens=8, structured_outputs=constraint))
        assert info.value.field == field_name and str(info.value).startswith(f"structured_outputs.{field_name}:")
        assert not engine.has_unfinished() and "bad" not in engine.requests
    with pytest.raises(StructuredOutputError, match="choice: must hold at least one string"):
        SamplingParams(structured_outputs={"choice": []})
    with pytest.raises(StructuredOutputError, match="exactly one of"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["a"]})
    with pytest.raises(SettingError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs={"choice": ["a"]})
    with pytest.raises(SettingError, match="min_tokens"):
        SamplingParams(min_tokens=2, max_tokens=8, structured_outputs={"choice": ["a"]})
    with pytest.raises(StructuredOutputError, match="not both"):
        SamplingParams(structured_outputs={"choice": ["a"]}, guided_decoding={"choice": ["b"]})


def test_the_llm_api_takes_vllms_names(llm: LLM):
    """StructuredOutputsParams, the older GuidedDecodingParams / guided_decoding, or a plain mapping."""
    prompts = [CHAT_PROMPTS[2], CHAT_PROMPTS[3]]
    choices = ["yes", "no"]
    for params in (SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=choices)),
                   SamplingParams(temperature=0, max_tokens=8, guided_decoding=GuidedDecodingParams(choice=choices)),
                   SamplingParams(temperature=0, max_tokens=8, structured_outputs={"choice": choices})):
        outputs = llm.generate(prompts, params)
        assert all(o.outputs[0].text in choices and o.outputs[0].finish_reason == "stop" for o in outputs)
        assert params.guided_decoding is None and isinstance(params.structured_outputs, StructuredOutputsParams)
