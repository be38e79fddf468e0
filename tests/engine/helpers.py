"""Helpers shared by the engine tests on the real model: explicit request ids, logits capture, HF reference."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from batchgen.engine import LLMEngine, RequestOutput, SamplingParams

NUM_GREEDY_TOKENS = 48  # the continuation length for the HF comparisons
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_GREEDY_TOKENS)


def run_requests(engine: LLMEngine, requests: dict[str, tuple[object, SamplingParams]]) -> dict[str, RequestOutput]:
    """Add every request under its own id (ids seed the samples), step until all finish."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    outputs: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out
    assert set(outputs) == set(requests)
    return outputs


@contextmanager
def captured_logits(engine: LLMEngine):
    """Record the raw logits the sampler is handed, keyed (request id, sample index, output index)."""
    runner = engine.runner
    sampler = runner.sampler
    records: dict[tuple[str, int, int], torch.Tensor] = {}

    class RecordingSampler:
        def sample(self, logits, batch, seqs, penalties):
            for row, seq in enumerate(seqs):
                records[(seq.request_id, seq.sample_index, seq.num_output_tokens)] = logits[row].detach().clone()
            return sampler.sample(logits, batch, seqs, penalties)

    runner.sampler = RecordingSampler()
    try:
        yield records
    finally:
        runner.sampler = sampler


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """max|ours - reference| / max|reference|: the issue's logits criterion."""
    return ((ours.float() - reference.float()).abs().max() / reference.float().abs().max()).item()


def truncate_at_eos(token_ids: list[int], eos_token_ids: tuple[int, ...]) -> list[int]:
    """HF pads finished rows after EOS; our outputs end with the EOS token itself."""
    for i, token in enumerate(token_ids):
        if token in eos_token_ids:
            return token_ids[:i + 1]
    return token_ids


@torch.no_grad()
def hf_greedy(hf_model, prompts: list[list[int]], max_new_tokens: int, eos_token_ids: tuple[int, ...],
              pad_token_id: int) -> list[list[int]]:
    """HF generate, greedy, all prompts in one left-padded batch (one pass over the weights per token)."""
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = hf_model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                            max_new_tokens=max_new_tokens, eos_token_id=list(eos_token_ids),
                            pad_token_id=pad_token_id)
    return [truncate_at_eos(row[width:].tolist(), eos_token_ids) for row in out]


@torch.no_grad()
def divergence_report(hf_model, prompt: list[int], ours: list[int], reference: list[int]) -> str:
    """Where two greedy continuations part, and HF's top-2 logit gap there (a near-tie or a real bug?)."""
    index = next((i for i, (a, b) in enumerate(zip(ours, reference)) if a != b), min(len(ours), len(reference)))
    logits = hf_model(torch.tensor([prompt + reference[:index]])).logits[0, -1].float()
    top = logits.topk(2)
    return (f"first difference at output token {index} (ours {ours[index:index + 1]}, HF "
            f"{reference[index:index + 1]}); HF top-2 {top.indices.tolist()} logit gap "
            f"{(top.values[0] - top.values[1]).item():.3g}")


def check_greedy_alone_and_batched(folder, prompts: list[list[int]], reference: list[list[int]], num_tokens: int,
                                   settings: dict, label: str = "") -> None:
    """Greedy `num_tokens` of each prompt equal `reference` (HF generate's) alone, then all batched in
    24-token chunked-prefill steps with prefix caching (prompt 0 first, so prompt 1 reuses its two cached
    blocks of 16)."""
    from batchgen.engine import LLM

    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    alone = LLM(str(folder), enable_prefix_caching=False, **settings)
    for i, ids in enumerate(prompts):
        out = run_requests(alone.engine, {f"alone-{i}": (ids, params)})[f"alone-{i}"]
        assert out.outputs[0].token_ids == reference[i], f"{label} prompt {i} alone"

    engine = LLM(str(folder), max_num_batched_tokens=24, enable_prefix_caching=True, **settings).engine
    first = run_requests(engine, {"p0": (prompts[0], params)})  # its two prefix blocks now cached
    outputs = first | run_requests(engine, {f"p{i}": (ids, params) for i, ids in enumerate(prompts) if i})
    assert outputs["p1"].num_cached_tokens == 32
    assert engine.stats["num_partial_prefills"] > 0  # 24-token steps split the long prompts
    for i in range(len(prompts)):
        assert outputs[f"p{i}"].outputs[0].token_ids == reference[i], f"{label} prompt {i} batched"


def shared_prefix_prompts(vocab_size: int) -> list[list[int]]:
    """8 seeded random prompts of 6 to 70 tokens; the first two begin with the same 40 tokens (two whole
    blocks of 16 and a partial one), so the second can reuse the first's cached prefix."""
    gen = torch.Generator().manual_seed(3)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, vocab_size, (n,), generator=gen).tolist()

    prefix = tokens(40)
    return [prefix + tokens(9), prefix + tokens(25)] + [tokens(n) for n in (6, 17, 33, 70, 12, 51)]


def check_prompt_logprobs(engine: LLMEngine, prompts: list[list[int]], expected: list[torch.Tensor],
                          label: str = "") -> None:
    """Each prompt's log-probabilities (prompt_logprobs=0) within 1e-4 of `expected[i]`, HF's float32
    log-softmax (prompt length, vocab) over that prompt."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outputs = run_requests(engine, {f"lp-{i}": (ids, params) for i, ids in enumerate(prompts)})
    for i, ids in enumerate(prompts):
        want = expected[i].gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
        positions = outputs[f"lp-{i}"].prompt_logprobs
        ours = torch.tensor([position[t].logprob for position, t in zip(positions[1:], ids[1:])])
        assert (ours - want).abs().max().item() <= 1e-4, f"{label} prompt {i}"
