"""The Triton backend's split-KV choice in a model runner, under TRITON_INTERPRET=1 (tests/conftest.py).

Chunks of 32 keys (SPLIT_SIZE lowered) and sequences of 40-70 tokens put two or three chunks in reach
of the tiny model. The backend splits a decode-only step whose sequences x KV heads are fewer than
the (stand-in) SM count, never a prefill or mixed step, and the tokens and logits are bitwise those
of a runner that never splits, eagerly and through the decode graphs (their workspace prepared per
graph size, before its capture).
"""

from __future__ import annotations

import pytest
import torch

from batchgen.engine.attention import triton as triton_backend
from batchgen.engine.attention.triton import TritonAttention
from batchgen.engine.runner.decode_graphs import EagerCapturer
from batchgen.engine.sampling.sampling_params import SamplingParams
from tests.engine.runner.test_decode_graphs import record_sampled_logits
from tests.engine.step_fixtures import TINY, advance, decode, make_seq, prefill, tiny_runner

pytestmark = pytest.mark.triton

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def chunks_of_32_keys(monkeypatch):
    monkeypatch.setattr(triton_backend, "SPLIT_SIZE", 32)


def long_sequences():
    """Prompts of 33 and 45 tokens (two chunks), four blocks each."""
    params = SamplingParams(temperature=0, max_tokens=16)
    return [make_seq(f"s{i}", [(7 * i + j) % 90 for j in range(n)], params, first_block=1 + 4 * i)
            for i, n in enumerate((33, 45))]


def runner_with(num_sms: int, **kwargs):
    runner = tiny_runner(CPU, num_blocks=12, max_num_seqs=2, backend_class=TritonAttention, **kwargs)
    runner.attention.num_sms = num_sms
    runner.attention.split_size = triton_backend.SPLIT_SIZE
    return runner


def record_workspaces(runner) -> list:
    """Each step's metadata's workspace (None: unsplit), as the runner builds them."""
    seen, build = [], runner.attention.build_packed

    def recording(step):
        meta = build(step)
        seen.append(meta.workspace)
        return meta

    runner.attention.build_packed = recording
    return seen


def decode_twice(runner, seqs, settings: list[dict]) -> list[torch.Tensor]:
    """The same decode step once per settings (attributes of the runner's builder, or graphs=None for
    an eager step), the sequences rolled back in between (its KV writes repeat the same values)."""
    logits = record_sampled_logits(runner)
    graphs = runner.graphs
    for i, setting in enumerate(settings):
        runner.graphs = setting.get("graphs", graphs)
        runner.attention.num_sms = setting.get("num_sms", runner.attention.num_sms)
        results = runner.execute(decode(seqs))
        if i < len(settings) - 1:
            continue
        advance(results)
    runner.graphs = graphs
    return logits


def test_the_choice_follows_batch_size_step_kind_and_length():
    builder = runner_with(num_sms=8).attention  # TINY: 2 KV heads
    assert builder.num_splits(3, 70, is_decode_only=True) == 3  # 6 programs < 8 SMs, 70 keys: 3 chunks
    assert builder.num_splits(4, 70, is_decode_only=True) == 0  # 8 programs fill the SMs
    assert builder.num_splits(3, 70, is_decode_only=False) == 0  # prefill or mixed: never
    assert builder.num_splits(3, 32, is_decode_only=True) == 0  # one chunk: nothing to split
    # One graph of 1 and one of 2 sequences split; their scratch held apart: 4 bytes x T x Hq x splits x (16 + 2).
    assert builder.graph_workspace_bytes([1, 2, 4], 64) == 4 * (1 + 2) * TINY.num_heads * 2 * (16 + 2)


def test_split_decodes_and_graph_replays_give_the_unsplit_logits_bit_for_bit():
    runner = runner_with(num_sms=64)
    capturer = EagerCapturer()
    runner.capture_decode_graphs(max_model_len=64, capturer=capturer)
    assert sorted(runner.attention.graph_workspaces) == [(1, 2), (2, 2)]  # 64 keys: 2 chunks
    workspaces = record_workspaces(runner)
    seqs = long_sequences()
    advance(runner.execute(prefill(seqs)))
    assert workspaces == [None]  # the prefill: unsplit
    for _ in range(2):
        del workspaces[:]
        split, unsplit, replayed = decode_twice(runner, seqs, [{"graphs": None, "num_sms": 64},
                                                               {"graphs": None, "num_sms": 1},
                                                               {"num_sms": 64}])
        assert workspaces[0] is not None and workspaces[0][0].shape[:3] == (2, TINY.num_heads, 2)
        assert workspaces[1] is None
        # The replay's step (prepare, then the graph's own build) took the 2-row graph's workspace.
        assert workspaces[-1] is runner.attention.graph_workspaces[(2, 2)]
        assert torch.equal(split, unsplit) and torch.equal(replayed, unsplit)
    assert capturer.num_replays == 2
