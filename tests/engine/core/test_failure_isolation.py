"""One request's failure in a step ends that request alone: its sample finishes with `error` and the
message, its blocks are freed, and every other request in the step gives the tokens it gives in a quiet
run (issue 39: a grammar the library gave up on failed all five requests of its step with a 500)."""

from __future__ import annotations

import pytest

from batchgen.engine import SamplingParams
from batchgen.engine.decoding.structured import StructuredOutputsParams
from tests.engine.helpers import run_requests
from tests.engine.prompts import CHAT_PROMPTS

NORMAL = SamplingParams(temperature=0.8, seed=7, max_tokens=12)
FAILS_AFTER = 3  # the planted grammar refuses the 4th token its mask allowed


@pytest.fixture(scope="module")
def engine(llm):
    return llm.with_engine_settings(max_num_seqs=16).engine


def normal_requests() -> dict:
    return {f"normal-{i}": (prompt, NORMAL) for i, prompt in enumerate(CHAT_PROMPTS[:4])}


def plant_refusal(engine, request_id: str) -> None:
    """The request's grammar refuses a token after FAILS_AFTER, as llguidance's matcher does when its
    lexer runs out of fuel mid-constraint (the token was in its mask; consuming it fails)."""
    for seq in engine.requests[request_id].seqs:
        grammar = seq.grammar
        accept = grammar.accept_token

        def refusing(token_id, grammar=grammar, accept=accept):
            return grammar.num_tokens < FAILS_AFTER and accept(token_id)
        grammar.accept_token = refusing


def test_a_failing_grammar_ends_its_request_alone(engine):
    quiet = run_requests(engine, normal_requests())
    free_before = engine.scheduler.kv_cache_manager.pool.num_free_blocks
    poisoned = SamplingParams(temperature=0.8, seed=3, max_tokens=12, n=2,
                              structured_outputs=StructuredOutputsParams(regex="[a-z ]{1,40}"))
    engine.add_request("poison", CHAT_PROMPTS[5], poisoned)
    plant_refusal(engine, "poison")
    for request_id, (prompt, params) in normal_requests().items():
        engine.add_request(request_id, prompt, params)
    outputs = {}
    while engine.has_unfinished():  # the poisoned request steps beside the others
        outputs.update((out.request_id, out) for out in engine.step())
    for c in outputs["poison"].outputs:
        assert c.finish_reason == "error" and "grammar refused token" in c.error
        assert len(c.token_ids) == FAILS_AFTER + 1  # the refused token ended it there
    for request_id, out in quiet.items():
        assert [c.token_ids for c in outputs[request_id].outputs] == [c.token_ids for c in out.outputs]
        assert all(c.finish_reason != "error" and c.error is None for c in outputs[request_id].outputs)
    assert not engine.has_unfinished()
    assert engine.scheduler.kv_cache_manager.pool.num_free_blocks == free_before  # its blocks came back


def test_non_finite_logits_end_their_request_alone(engine, monkeypatch):
    """A row whose logits turn NaN (what damaged weights or a float16 overflow give) ends its sample with
    an error instead of drawing tokens from nothing; the others in the step are unchanged."""
    quiet = run_requests(engine, normal_requests())
    runner, sampler = engine.runner, engine.runner.sampler

    class PoisoningSampler:
        def sample(self, logits, batch, seqs, penalties):
            for row, seq in enumerate(seqs):
                if seq.request_id == "poison" and seq.num_output_tokens >= FAILS_AFTER:
                    logits[row, 100] = float("nan")
            return sampler.sample(logits, batch, seqs, penalties)

    monkeypatch.setattr(runner, "sampler", PoisoningSampler())
    engine.add_request("poison", CHAT_PROMPTS[5], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for request_id, (prompt, params) in normal_requests().items():
        engine.add_request(request_id, prompt, params)
    outputs = {}
    while engine.has_unfinished():
        outputs.update((out.request_id, out) for out in engine.step())
    poison = outputs["poison"].outputs[0]
    assert poison.finish_reason == "error" and "not finite" in poison.error
    assert len(poison.token_ids) == FAILS_AFTER + 1
    for request_id, out in quiet.items():
        assert [c.token_ids for c in outputs[request_id].outputs] == [c.token_ids for c in out.outputs]
