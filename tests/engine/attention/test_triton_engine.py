"""The whole engine through `attention_backend: triton` on the CPU, under TRITON_INTERPRET=1 (tests/conftest.py).

A 2-layer random-weight Llama in float32 (head_dim 32, 4 query heads per KV head), the same steps as
the C kernels' path: fresh prompts, a prefix-cache hit, chunked prefills and preemptions (a KV pool
too small for the batch). Greedy tokens must equal the C kernels' token for token, and each request's
logits must be bitwise the same alone as in the batch (the Triton kernel's fixed tiles read every
key from the cache in order, whatever the batch, the chunking or a recomputation after preemption).

torch's CPU GEMMs are not batch-invariant themselves (a row's last bits depend on how many rows are
multiplied with it), so both engines run their linear layers one row at a time: what is left to
differ between alone and in a batch is what this issue built (attention, KV store, step layout).
"""

from __future__ import annotations

import random

import pytest
import torch

from batchgen.engine import EngineConfig, LLMEngine, SamplingParams
from tests.engine.helpers import captured_logits, run_requests
from tests.pipeline.tiny_model import write_tiny_model

pytestmark = pytest.mark.triton

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SHAPE = dict(hidden=128, intermediate=256, num_layers=2, num_heads=4, num_kv_heads=1)  # head_dim 32, GQA 4
# A pool of 12 blocks of 16 tokens for up to 8 sequences of up to ~60 tokens: the batch preempts;
# 24 batched tokens per step: the longer prompts are prefilled in chunks.
ENGINE = dict(dtype="float32", device="cpu", max_model_len=128, block_size=16, num_kv_blocks=12,
              max_num_seqs=8, max_num_batched_tokens=24)


def prompts(vocab_size: int) -> dict[str, list[int]]:
    rng = random.Random(0)
    lengths = [1, 15, 16, 17, 33, 40, 5, 23]
    out = {f"p{i}": [rng.randrange(vocab_size) for _ in range(n)] for i, n in enumerate(lengths)}
    return out


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, hf_tokenizer):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", hf_tokenizer, weight_std=0.3, vocab_size=1024, **SHAPE)


def linear_rows_one_at_a_time(model: torch.nn.Module) -> int:
    """Every linear layer (packed or not) computes each row of its input alone: (T, K) -> T calls of (1, K)."""
    count = 0
    for module in model.modules():
        if hasattr(module, "weight") and module.__class__.__name__.endswith("Linear"):
            forward = module.forward
            module.forward = lambda x, _f=forward: (
                torch.cat([_f(x[i:i + 1]) for i in range(x.shape[0])]) if x.shape[0] > 1 else _f(x))
            count += 1
    return count


@pytest.fixture(scope="module")
def engines(tiny_folder):
    engines = {backend: LLMEngine(EngineConfig(model=str(tiny_folder), attention_backend=backend, **ENGINE))
               for backend in ("cpu", "triton")}
    for engine in engines.values():
        assert linear_rows_one_at_a_time(engine.runner.model) == 2 * 4 + 1  # qkv, o, gate_up, down; lm_head
    return engines


def run_two_waves(engine: LLMEngine, requests: dict[str, list[int]]) -> tuple[dict, dict]:
    """All prompts in one batch, then a prompt that shares p4's first two blocks (a prefix-cache hit).
    Returns (greedy tokens by request, logits by (request, output index))."""
    with captured_logits(engine) as logits:
        outs = run_requests(engine, {rid: (p, GREEDY) for rid, p in requests.items()})
        hit = requests["p4"][:32] + [7, 8, 9]
        outs.update(run_requests(engine, {"hit": (hit, GREEDY)}))
    return ({rid: out.outputs[0].token_ids for rid, out in outs.items()},
            {(rid, index): row for (rid, _, index), row in logits.items()})


def test_triton_engine_matches_the_c_kernels_and_is_batch_invariant(engines):
    cpu, triton = engines["cpu"], engines["triton"]
    assert triton.stats["kernels"]["attention_backend"] == "triton"
    assert cpu.stats["kernels"]["attention_backend"] == "cpu"
    requests = prompts(triton.model_cfg.vocab_size)
    cpu_tokens, _ = run_two_waves(cpu, requests)
    triton_tokens, batch_logits = run_two_waves(triton, requests)
    stats = triton.stats
    assert stats["num_preemptions"] > 0 and stats["num_partial_prefills"] > 0 and stats["num_cached_tokens"] >= 32
    assert stats["num_preemptions"] == cpu.stats["num_preemptions"]
    assert triton_tokens == cpu_tokens
    assert len({tuple(t) for t in triton_tokens.values()}) > 4  # not one degenerate continuation
    # Alone: each request in a fresh engine sharing the weights, nothing cached, nothing to preempt for.
    for rid, prompt in requests.items():
        alone = LLMEngine(triton.config.replace(num_kv_blocks=16), weights_from=triton)
        with captured_logits(alone) as logits:
            run_requests(alone, {rid: (prompt, GREEDY)})
        for (_, _, index), row in logits.items():
            assert torch.equal(row, batch_logits[(rid, index)]), f"{rid} output {index} differs alone"
