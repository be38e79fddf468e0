"""The decoding features stay exact on mixture-of-experts models (Mixtral, Qwen3-MoE, Qwen2-MoE; the tiny random
families of test_moe.py), each against HF transformers running the same weights:

- n-gram speculative decoding: greedy tokens equal HF `generate(use_cache=False)` (the verify chunks run
  the experts on k + 1 rows a sequence; prompts that repeat a span make the n-gram proposer draft). The
  reference recomputes every position each step: on one repeating Mixtral prompt HF's cached decode
  picks another token at step 15 than its own full forward (whose top two logits there are 0.018 apart;
  the cause inside HF not traced), and batchgen, with speculation or without, equals the full forward;
- beam search: the best beam and its score equal HF `generate(num_beams=4)`;
- structured output: a regex-constrained greedy output (JSON objects of SCHEMA with no free whitespace: a
  JSON-schema constraint lets random weights emit whitespace until max_tokens) equals HF `generate` with
  the same grammar masking HF's logits (a LogitsProcessor walking the grammar the engine compiles);
  every output completes and validates against SCHEMA.
Prefix caching and prompt log-probabilities: test_moe.py.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from batchgen.engine import LLM, SamplingParams
from batchgen.engine.decoding.structured import (
    GrammarCompiler,
    StructuredOutputsParams,
    allocate_token_bitmask,
    bitmask_to_allowed,
)
from tests.engine.decoding.test_beam_search import hf_beams
from tests.engine.helpers import run_requests
from tests.engine.models.test_moe import SETTINGS, family, prompts  # noqa: F401 (fixtures)

EOS = 2  # the tiny configs' eos_token_id
WIDTH = 4  # hf_beams' num_beams
BEAM_TOKENS = 24  # hf_beams' max_new_tokens
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
PERSON_REGEX = r'\{"name": "[a-z]{1,8}", "age": (1[01][0-9]|120|[1-9]?[0-9])\}'


@pytest.fixture(scope="module")
def repeating_prompts(prompts):  # noqa: F811 (the fixture imported above)
    """4 of the prompts, each followed by its own first 12 tokens twice: spans the n-gram proposer finds."""
    return [ids + ids[:12] + ids[:12] for ids in prompts[2:6]]


@torch.no_grad()
def hf_generate_uncached(hf, prompt: list[int], num_tokens: int = 32) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=num_tokens,
                      min_new_tokens=num_tokens, pad_token_id=0, use_cache=False)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def test_ngram_speculation_keeps_greedy_tokens_equal_to_hf_generate(family, prompts, repeating_prompts):  # noqa: F811
    architecture, hf, folder = family
    cases = prompts + repeating_prompts
    reference = [hf_generate_uncached(hf, ids) for ids in cases]
    llm = LLM(str(folder), max_num_seqs=16,
              speculative={"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 16}, **SETTINGS)
    params = SamplingParams(temperature=0, max_tokens=len(reference[0]), ignore_eos=True)
    outputs = run_requests(llm.engine, {f"p{i}": (ids, params) for i, ids in enumerate(cases)})
    for i in range(len(cases)):
        assert outputs[f"p{i}"].outputs[0].token_ids == reference[i], f"{architecture} prompt {i}"
    stats = llm.engine.stats["speculative"]
    print(f"\n{architecture}: {stats['num_draft_tokens']} drafts, acceptance {stats['acceptance_rate']:.3f}")
    assert stats["num_draft_tokens"] > 0
    if architecture == "Qwen3MoeForCausalLM":  # some drafts accepted (Mixtral's random weights reject all of them)
        assert stats["num_accepted_tokens"] > 0


@torch.no_grad()
def test_beam_search_best_beam_and_score_equal_hf_generate(family, prompts):  # noqa: F811
    architecture, hf, folder = family
    chosen = prompts[2:6]
    reference = hf_beams(hf, chosen, (EOS,), early_stopping=False)
    llm = LLM(str(folder), max_num_seqs=16, **SETTINGS)
    params = SamplingParams(beam_width=WIDTH, n=WIDTH, temperature=0, max_tokens=BEAM_TOKENS, logprobs=0)
    outputs = run_requests(llm.engine, {f"beam-{i}": (ids, params) for i, ids in enumerate(chosen)})
    for i, (tokens, score) in enumerate(reference):
        best = outputs[f"beam-{i}"].outputs[0]
        assert best.token_ids == tokens, f"{architecture} prompt {i}"
        assert best.cumulative_logprob / len(best.token_ids) == pytest.approx(score, abs=1e-4), f"{architecture} {i}"


class GrammarMask:
    """An HF LogitsProcessor (batch 1): the grammar's allowed next tokens, the rest -inf."""

    def __init__(self, state, prompt_len: int, vocab_size: int):
        self.state, self.prompt_len, self.vocab_size = state, prompt_len, vocab_size
        self.bitmask = allocate_token_bitmask(1, vocab_size)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids[0, self.prompt_len:].tolist()
        assert self.state.accept_tokens(generated[self.state.num_tokens:])
        self.state.fill_bitmask(self.bitmask, 0)
        allowed = bitmask_to_allowed(self.bitmask, self.vocab_size)[0]
        return scores.masked_fill(~allowed[None, :scores.shape[1]], float("-inf"))


@torch.no_grad()
def test_constrained_output_equals_hf_generate_under_the_same_grammar(family, prompts, hf_tokenizer):  # noqa: F811
    from transformers import LogitsProcessorList

    architecture, hf, folder = family
    vocab_size = hf.config.vocab_size
    compiler = GrammarCompiler(hf_tokenizer, vocab_size, [EOS])
    structured = StructuredOutputsParams(regex=PERSON_REGEX)
    max_tokens = 48
    llm = LLM(str(folder), max_num_seqs=16, **SETTINGS)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs={"regex": PERSON_REGEX})
    chosen = prompts[:4]
    outputs = run_requests(llm.engine, {f"s{i}": (ids, params) for i, ids in enumerate(chosen)})
    for i, ids in enumerate(chosen):
        mask = GrammarMask(compiler.new_state(structured), len(ids), vocab_size)
        prompt = torch.tensor([ids])
        out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=max_tokens,
                          logits_processor=LogitsProcessorList([mask]), eos_token_id=EOS, pad_token_id=0)
        expected = out[0, len(ids):].tolist()
        ours = outputs[f"s{i}"].outputs[0]
        assert ours.token_ids == expected, f"{architecture} prompt {i}"
        assert ours.finish_reason == "stop" and ours.token_ids[-1] == EOS
        jsonschema.validate(json.loads(hf_tokenizer.decode(ours.token_ids[:-1])), SCHEMA)
