"""Beam search against HF transformers' `generate(num_beams=4, do_sample=False, length_penalty=1.0)` on the
bundled model: 16 prompts x 24 tokens, HF's default stopping rule (early_stopping=False) and, on a few,
early_stopping=True; the best sequence and its score equal HF's. Beams share the prompt's blocks and every
full block since: the most KV blocks a request holds at once stays below beam_width x one beam's own."""

from __future__ import annotations

import math

import pytest
import torch

from batchgen.engine import BeamSearchParams, SamplingParams
from batchgen.engine.decoding.beam_search import beam_score
from batchgen.engine.sampling.sampling_params import MAX_LENGTH_PENALTY
from tests.engine.prompts import INVARIANCE_PROMPTS

WIDTH = 4
NUM_TOKENS = 24
NUM_PROMPTS = 16
SCORE_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def prompt_ids(llm) -> list[list[int]]:
    return [llm.engine.encode(messages) for messages in INVARIANCE_PROMPTS[:NUM_PROMPTS]]


@torch.no_grad()
def hf_beams(hf_model, prompts: list[list[int]], eos: tuple[int, ...], early_stopping) -> list[tuple[list[int], float]]:
    """HF's best beam of each prompt (its padding after EOS cut) and its sequence score: one left-padded
    batch (HF derives positions from the attention mask)."""
    width = max(len(ids) for ids in prompts)
    input_ids = torch.tensor([[eos[0]] * (width - len(ids)) + ids for ids in prompts])
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts])
    out = hf_model.generate(input_ids=input_ids, attention_mask=mask, num_beams=WIDTH, do_sample=False,
                            length_penalty=1.0, early_stopping=early_stopping, max_new_tokens=NUM_TOKENS,
                            eos_token_id=list(eos), pad_token_id=eos[0], output_scores=True,
                            return_dict_in_generate=True)
    best = []
    for row, score in zip(out.sequences, out.sequences_scores.tolist()):
        tokens = row[width:].tolist()
        end = next((i for i, t in enumerate(tokens) if t in eos), len(tokens) - 1)
        best.append((tokens[:end + 1], score))
    return best


def run_with_block_count(engine, prompt_ids, params):
    """Every request's outputs, and per request the most KV blocks its live beams held at once (distinct)
    beside what one beam alone needed then (its own blocks), measured after every step."""
    for i, ids in enumerate(prompt_ids):
        engine.add_request(f"beam-{i}", None, params, prompt_token_ids=ids)
    peak: dict[str, tuple[int, int]] = {}
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out
        for request_id in engine.requests:
            beams = engine.sequences(request_id)
            held = len({b for seq in beams for b in seq.block_ids})
            alone = max(len(seq.block_ids) for seq in beams)
            if held > peak.get(request_id, (0, 0))[0]:
                peak[request_id] = (held, alone)
    return outputs, peak


@pytest.mark.slow
def test_sixteen_prompts_equal_hf_generate_num_beams_4(llm, hf_model, prompt_ids):
    engine = llm.engine
    eos = engine.eos_token_ids
    params = SamplingParams(beam_width=WIDTH, n=WIDTH, temperature=0, max_tokens=NUM_TOKENS, logprobs=0)
    outputs, peak = run_with_block_count(engine, prompt_ids, params)
    reference = hf_beams(hf_model, prompt_ids, eos, early_stopping=False)
    for i, (expected_tokens, expected_score) in enumerate(reference):
        out = outputs[f"beam-{i}"]
        best = out.outputs[0]
        assert best.token_ids == expected_tokens, f"prompt {i}"
        assert abs(best.score - expected_score) <= SCORE_TOLERANCE, f"prompt {i}"
        scores = [c.score for c in out.outputs]
        assert len(out.outputs) == WIDTH and scores == sorted(scores, reverse=True)
        assert best.cumulative_logprob == pytest.approx(sum(best.logprobs), abs=1e-4)
        assert best.score == pytest.approx(best.cumulative_logprob / len(best.token_ids))
        held, alone = peak[f"beam-{i}"]
        assert held < WIDTH * alone, f"prompt {i}: {held} blocks held, one beam alone {alone}"
    assert engine.stats["num_block_copies"] > 0  # forks copied the shared partial block before writing
    pool = engine.kv_cache_manager.pool
    assert all(count == 0 for count in pool.ref_counts) and pool.num_free_blocks == pool.num_blocks


def test_early_stopping_true_and_the_llm_api(llm, hf_model, prompt_ids):
    eos = llm.engine.eos_token_ids
    chosen = prompt_ids[:2]
    outputs = llm.beam_search([{"prompt_token_ids": ids} for ids in chosen],
                              BeamSearchParams(beam_width=WIDTH, max_tokens=NUM_TOKENS, early_stopping=True))
    for ids, out, (expected_tokens, expected_score) in zip(chosen, outputs,
                                                           hf_beams(hf_model, chosen, eos, early_stopping=True)):
        best = out.sequences[0]
        assert best.tokens == ids + expected_tokens
        assert abs(best.score - expected_score) <= SCORE_TOLERANCE
        assert len(out.sequences) == WIDTH and best.text == llm.tokenizer.decode(expected_tokens)


@pytest.mark.parametrize("settings, field", [
    ({"temperature": 0.7}, "temperature"),
    ({"temperature": 0, "top_p": 0.9}, "top_p"),
    ({"temperature": 0, "n": 5}, "n"),
    ({"temperature": 0, "stop": ["x"]}, "stop"),
    ({"temperature": 0, "logprobs": 2}, "logprobs"),
])
def test_sampling_settings_with_beam_search_are_refused_by_name(settings, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field} "):
        SamplingParams(beam_width=WIDTH, **settings)


@pytest.mark.parametrize("length_penalty", [MAX_LENGTH_PENALTY, -MAX_LENGTH_PENALTY, 1e308, -1e308,
                                            math.inf, -math.inf])
@pytest.mark.parametrize("num_generated", [0, 1, 2, 2 ** 20, 2 ** 63])
@pytest.mark.parametrize("cumulative_logprob", [-1e4, -1.5, 0.0])
def test_beam_score_raises_nothing_at_the_bounds_and_past_them(cumulative_logprob, num_generated,
                                                               length_penalty):
    score = beam_score(cumulative_logprob, num_generated, length_penalty)
    assert not math.isnan(score) and score <= 0
    if abs(length_penalty) <= MAX_LENGTH_PENALTY:  # SamplingParams' range: always finite
        assert math.isfinite(score)
        expected = cumulative_logprob / max(num_generated, 1) ** length_penalty
        assert score == expected


@pytest.mark.parametrize("length_penalty", [MAX_LENGTH_PENALTY, -MAX_LENGTH_PENALTY])
def test_beam_search_runs_at_the_length_penalty_bounds(llm, prompt_ids, length_penalty):
    outputs = llm.beam_search([{"prompt_token_ids": prompt_ids[0]}],
                              BeamSearchParams(beam_width=2, max_tokens=6, length_penalty=length_penalty))
    scores = [seq.score for seq in outputs[0].sequences]
    assert len(scores) == 2 and all(math.isfinite(s) for s in scores)
    assert scores == sorted(scores, reverse=True)
