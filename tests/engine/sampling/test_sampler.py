"""Sampler properties on synthetic logits (CPU, no model): filters, seeded draws, penalties, params.

The allowed set of each filter is recomputed here in float64 from its definition (HF's order:
temperature, top-k, top-p over the top-k renormalized distribution, then min-p), independently
of the sampler's sort-and-mask code.
"""

from __future__ import annotations

import pytest
import torch

from batchgen.engine.config import SettingError
from batchgen.engine.core.sequence import Sequence
from batchgen.engine.sampling.sampler import Sampler, apply_min_tokens, apply_penalties, filter_logits
from batchgen.engine.sampling.sampling_params import MAX_N, SamplingParams

VOCAB = 64
EOS = 63


def make_seq(params: SamplingParams, request_id: str = "r", sample_index: int = 0,
             prompt: list[int] | None = None, output: list[int] | None = None) -> Sequence:
    seq = Sequence(request_id, sample_index, list(prompt or [0, 1]), params, 0.0, 10_000)
    seq.token_ids.extend(output or [])
    return seq


def allowed_tokens(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> set[int]:
    """The tokens a (temperature-scaled) logits row may emit, from the definitions."""
    probs = logits.double().softmax(-1)
    order = torch.argsort(probs, descending=True).tolist()
    kept = order[:top_k] if top_k > 0 else order
    mass = sum(probs[t].item() for t in kept)
    nucleus, mass_before = [], 0.0
    for t in kept:  # smallest prefix whose renormalized mass reaches top_p
        if mass_before >= top_p:
            break
        nucleus.append(t)
        mass_before += probs[t].item() / mass
    top = probs[order[0]].item()
    return {t for t in nucleus if probs[t].item() >= min_p * top}


def draws_at_successive_positions(sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence],
                                  num_positions: int) -> list[list[int]]:
    """Sample every sequence at `num_positions` successive output positions (each drawn token is
    appended, as the engine does): the keyed draws differ by position, not by call."""
    result = []
    for _ in range(num_positions):
        tokens, _ = sampler(logits.clone(), seqs)
        for seq, token in zip(seqs, tokens):
            seq.token_ids.append(token)
        result.append(tokens)
    return result


FILTER_CASES = [  # (top_k, top_p, min_p)
    (1, 1.0, 0.0), (5, 1.0, 0.0), (VOCAB, 1.0, 0.0),
    (-1, 0.5, 0.0), (-1, 0.9, 0.0), (-1, 0.05, 0.0),
    (-1, 1.0, 0.1), (-1, 1.0, 0.5),
    (10, 0.8, 0.0), (20, 0.9, 0.05), (-1, 0.7, 0.2),
]


@pytest.mark.parametrize("top_k, top_p, min_p", FILTER_CASES)
def test_filter_logits_keeps_exactly_the_allowed_set(top_k, top_p, min_p):
    gen = torch.Generator().manual_seed(hash((top_k, top_p, min_p)) & 0xFFFF)
    logits = torch.randn(200, VOCAB, generator=gen) * 3  # (N, V)
    k = torch.full((200,), VOCAB if top_k == -1 else top_k)
    filtered = filter_logits(logits.clone(), k, torch.full((200,), top_p), torch.full((200,), min_p))
    for row in range(200):
        kept = set(torch.nonzero(torch.isfinite(filtered[row])).flatten().tolist())
        assert kept == allowed_tokens(logits[row], top_k, top_p, min_p), f"row {row}"
        finite = torch.isfinite(filtered[row])
        assert torch.equal(filtered[row][finite], logits[row][finite])  # kept logits untouched


def test_filter_logits_rows_keep_their_own_settings():
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(3, VOCAB, generator=gen) * 3
    filtered = filter_logits(logits.clone(), torch.tensor([2, VOCAB, VOCAB]), torch.tensor([1.0, 0.5, 1.0]),
                             torch.tensor([0.0, 0.0, 0.3]))
    for row, (k, p, m) in enumerate([(2, 1.0, 0.0), (-1, 0.5, 0.0), (-1, 1.0, 0.3)]):
        kept = set(torch.nonzero(torch.isfinite(filtered[row])).flatten().tolist())
        assert kept == allowed_tokens(logits[row], k, p, m)


@pytest.mark.parametrize("top_k, top_p, min_p", [(3, 1.0, 0.0), (-1, 0.6, 0.0), (-1, 1.0, 0.2),
                                                  (8, 0.9, 0.1)])
def test_sampler_never_emits_a_filtered_token(top_k, top_p, min_p):
    temperature = 0.8
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(128, VOCAB, generator=gen) * 2
    seqs = [make_seq(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=s),
                     request_id=f"req-{s}") for s in range(128)]
    allowed = [allowed_tokens(logits[i] / temperature, top_k, top_p, min_p) for i in range(128)]
    sampler = Sampler(eos_token_ids=(EOS,))
    num_multi_choice_draws = 0
    distinct_per_row = [set() for _ in range(128)]
    for tokens in draws_at_successive_positions(sampler, logits, seqs, 25):  # 25 positions of 128 samples
        for i, token in enumerate(tokens):
            assert token in allowed[i], f"row {i}: token {token} outside {sorted(allowed[i])}"
            distinct_per_row[i].add(token)
            num_multi_choice_draws += len(allowed[i]) > 1
    # The draws are random, not argmax: rows with several allowed tokens emit several of them.
    multi = [i for i in range(128) if len(allowed[i]) > 1]
    assert multi and sum(len(distinct_per_row[i]) > 1 for i in multi) > len(multi) // 2


def test_sampled_frequencies_follow_the_tempered_distribution():
    gen = torch.Generator().manual_seed(3)
    row = torch.randn(VOCAB, generator=gen)
    temperature, num_seqs, num_draws = 0.7, 400, 10
    logits = row.expand(num_seqs, VOCAB).clone()
    seqs = [make_seq(SamplingParams(temperature=temperature, top_k=6, seed=0), request_id=f"r{i}")
            for i in range(num_seqs)]
    sampler = Sampler(eos_token_ids=(EOS,))
    counts = torch.zeros(VOCAB)
    for tokens in draws_at_successive_positions(sampler, logits, seqs, num_draws):
        counts += torch.bincount(torch.tensor(tokens), minlength=VOCAB)
    top6 = torch.topk(row, 6).indices
    expected = torch.zeros(VOCAB)
    expected[top6] = (row[top6] / temperature).softmax(-1)
    observed = counts / counts.sum()
    # 4000 draws: a proportion's standard error is at most 0.008; 0.04 is five of them.
    assert (observed - expected).abs().max().item() < 0.04
    assert observed[expected == 0].sum().item() == 0


def test_seeded_draws_repeat_and_depend_on_seed_request_and_sample_index():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(1, VOCAB, generator=gen).expand(4, VOCAB).clone()

    def draws(specs):
        seqs = [make_seq(SamplingParams(temperature=1.0, seed=seed, n=2), request_id=rid, sample_index=idx)
                for seed, rid, idx in specs]
        sampler = Sampler(eos_token_ids=(EOS,))
        return [tuple(col) for col in zip(*draws_at_successive_positions(sampler, logits, seqs, 20))]

    specs = [(1, "a", 0), (1, "a", 1), (1, "b", 0), (2, "a", 0)]
    first = draws(specs)
    assert draws(specs) == first  # reproducible
    assert draws(list(reversed(specs))) == list(reversed(first))  # batch order does not matter
    assert len(set(first)) == 4  # each (seed, request id, sample index) has its own stream


@pytest.mark.parametrize("is_c_sampling", [False, True])
def test_greedy_rows_take_the_argmax_and_report_raw_logprobs(is_c_sampling):
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(3, VOCAB, generator=gen)
    seqs = [make_seq(SamplingParams(temperature=0)),
            make_seq(SamplingParams(temperature=0, repetition_penalty=2.0), output=[int(logits[1].argmax())]),
            make_seq(SamplingParams(temperature=0.5, seed=1))]
    tokens, logprobs = Sampler(eos_token_ids=(EOS,), is_c_sampling=is_c_sampling)(logits.clone(), seqs)
    assert tokens[0] == int(logits[0].argmax())
    penalized = apply_penalties(logits[1:2].clone(), seqs[1:2])
    assert tokens[1] == int(penalized.argmax())
    raw = logits.log_softmax(-1)
    assert logprobs == pytest.approx([raw[i, t].item() for i, t in enumerate(tokens)], abs=1e-6)


@pytest.mark.parametrize("is_c_sampling", [False, True])
def test_min_tokens_bans_eos_and_still_reports_raw_logprobs(is_c_sampling):
    """min_tokens edits the logits in place (no copy); the chosen tokens' raw log-probabilities survive."""
    gen = torch.Generator().manual_seed(10)
    logits = torch.randn(2, VOCAB, generator=gen)
    logits[:, EOS] = 50.0  # EOS is every row's argmax
    seqs = [make_seq(SamplingParams(temperature=0, min_tokens=3)), make_seq(SamplingParams(temperature=0))]
    raw = logits.log_softmax(-1)
    tokens, logprobs = Sampler(eos_token_ids=(EOS,), is_c_sampling=is_c_sampling)(logits.clone(), seqs)
    assert tokens[1] == EOS and tokens[0] != EOS
    without_eos = logits[0].clone()
    without_eos[EOS] = float("-inf")
    assert tokens[0] == int(without_eos.argmax())
    assert logprobs == pytest.approx([raw[i, t].item() for i, t in enumerate(tokens)], abs=1e-5)


# ---- penalties and min_tokens ----------------------------------------------------------------------

def test_penalties_follow_vllm_semantics():
    gen = torch.Generator().manual_seed(13)
    logits = torch.randn(2, VOCAB, generator=gen) * 2
    prompt, output = [1, 2, 3], [3, 4, 4, 5, 5, 5]
    params = SamplingParams(temperature=0, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.25)
    seqs = [make_seq(params, prompt=prompt, output=output), make_seq(SamplingParams(temperature=0))]
    result = apply_penalties(logits.clone(), seqs)

    expected = logits[0].clone()
    for token in set(prompt) | set(output):  # repetition: prompt and output tokens
        value = expected[token]
        expected[token] = value / 1.5 if value > 0 else value * 1.5
    for token in set(output):  # presence and frequency: output tokens only
        expected[token] -= 0.5 + 0.25 * output.count(token)
    torch.testing.assert_close(result[0], expected, rtol=0, atol=1e-6)
    assert torch.equal(result[1], logits[1])  # a row without penalties is untouched
    changed = set(torch.nonzero(result[0] != logits[0]).flatten().tolist())
    assert changed <= {1, 2, 3, 4, 5}


def test_negative_presence_and_frequency_penalties_encourage_repeats():
    logits = torch.zeros(1, VOCAB)
    seq = make_seq(SamplingParams(temperature=0, presence_penalty=-1.0, frequency_penalty=-0.5), output=[7, 7])
    result = apply_penalties(logits.clone(), [seq])
    assert result[0, 7].item() == pytest.approx(2.0)
    assert int(result[0].argmax()) == 7


def test_min_tokens_bans_eos_and_stop_tokens_until_reached():
    logits = torch.zeros(2, VOCAB)
    params = SamplingParams(temperature=0, min_tokens=3, max_tokens=8, stop_token_ids=[9])
    early = make_seq(params, output=[1, 2])  # 2 < 3 outputs so far
    done = make_seq(params, output=[1, 2, 3])
    result = apply_min_tokens(logits.clone(), [early, done], eos_token_ids=(EOS,))
    assert result[0, EOS] == float("-inf") and result[0, 9] == float("-inf")
    assert torch.isfinite(result[0, :9]).all()
    assert torch.equal(result[1], logits[1])


# ---- SamplingParams validation ----------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 0}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.1}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 2, "temperature": 0}, "n"),
    ({"n": 0}, "n"),
    ({"stop": [""]}, "stop"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    # Non-finite and out-of-range values, as vLLM refuses them (NaN fails every range).
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": 100.01}, "temperature"),
    ({"top_p": float("nan")}, "top_p"),
    ({"min_p": float("nan")}, "min_p"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty"),
    ({"presence_penalty": 2.01}, "presence_penalty"),
    ({"presence_penalty": float("-inf")}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"n": MAX_N + 1, "temperature": 1.0}, "n"),
    ({"stop_token_ids": [3, -1]}, "stop_token_ids"),
])
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(SettingError, match=rf"^SamplingParams\.{field} .*; got ") as info:
        SamplingParams(**kwargs)
    assert info.value.name == field  # what the job file turns into `sampling.<field>`


def test_valid_edge_values_are_accepted():
    SamplingParams(temperature=0, top_p=1.0, top_k=-1, min_p=1.0, max_tokens=1)
    SamplingParams(temperature=0.5, top_k=1, min_p=0.0, n=3, stop="###")
    SamplingParams(temperature=100, n=MAX_N, repetition_penalty=1e-6, presence_penalty=-2, frequency_penalty=2,
                   stop_token_ids=[0])
    assert SamplingParams(stop="###").stop == ["###"]


def test_every_packed_sampling_section_is_a_sampling_batch_field():
    """The section groups are declared once; attach_sampling_tensors sets SamplingBatch's field of the same name."""
    import dataclasses

    from batchgen.engine.sampling.sampling_batch import SECTION_GROUPS, SamplingBatch

    batch_fields = {f.name for f in dataclasses.fields(SamplingBatch)}
    section_fields = [f.name for group in SECTION_GROUPS for f in dataclasses.fields(group)]
    assert len(section_fields) == len(set(section_fields))
    assert set(section_fields) - batch_fields == set()
