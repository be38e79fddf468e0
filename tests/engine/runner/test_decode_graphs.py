"""Decode CUDA graphs' size selection and padding, on the CPU with an eager stand-in for the capture."""

from __future__ import annotations

import pytest
import torch

from batchgen.engine.runner.decode_graphs import EagerCapturer, graph_batch_sizes, padded_batch_size
from batchgen.engine.sampling.sampling_params import SamplingParams
from tests.engine.step_fixtures import advance, decode, make_seq, prefill, tiny_runner

CPU = torch.device("cpu")


def test_batch_sizes_are_powers_of_two_then_multiples_of_sixteen_up_to_the_largest():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert graph_batch_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    sizes = graph_batch_sizes(256)
    assert sizes[:6] == [1, 2, 4, 8, 16, 32] and sizes[-1] == 256 and len(sizes) == 4 + 16
    assert [padded_batch_size(n, sizes) for n in (1, 3, 5, 9, 17, 33, 255, 256)] == [1, 4, 8, 16, 32, 48, 256, 256]
    assert padded_batch_size(257, sizes) is None
    # At most 15 padding rows per replay (at most 7 below 16).
    assert max(padded_batch_size(n, sizes) - n for n in range(1, 257)) == 15


def test_max_cuda_graph_size_caps_the_captured_sizes():
    runner = tiny_runner(CPU, max_num_seqs=16, max_cuda_graph_size=4)
    capturer = EagerCapturer()
    runner.capture_decode_graphs(max_model_len=64, capturer=capturer)
    assert sorted(runner.graphs.graphs) == [1, 2, 4] and capturer.num_captures == 3
    seqs = _three_sequences() + [make_seq("r3", [1, 2, 3], SamplingParams(temperature=0, max_tokens=16),
                                          first_block=13), make_seq("r4", [4, 5], SamplingParams(temperature=0,
                                                                                                  max_tokens=16),
                                                                    first_block=17)]
    advance(runner.execute(prefill(seqs)))
    advance(runner.execute(decode(seqs)))  # 5 rows: past the largest graph, eager
    assert capturer.num_replays == 0
    advance(runner.execute(decode(seqs[:4])))
    assert capturer.num_replays == 1


@pytest.mark.triton
def test_fp8_kv_scales_come_from_the_first_real_prefill_not_the_capture():
    """calculate_kv_scales: the capture's warm-up runs padding rows (token 0 at position 0), so a runner
    that captured at start would take its scales from them. The capture waits for the first real step:
    the scales equal an eager runner's, taken from the same prefill, and decodes then replay."""
    from batchgen.engine.attention.triton import TritonAttention

    settings = dict(backend_class=TritonAttention, kv_cache_dtype="fp8", calculate_kv_scales=True)
    eager, graphed = tiny_runner(CPU, max_num_seqs=4, **settings), tiny_runner(CPU, max_num_seqs=4, **settings)
    capturer = EagerCapturer()
    graphed.capture_decode_graphs(max_model_len=64, capturer=capturer)
    assert graphed.graphs is None and capturer.num_captures == 0  # waiting for the scales
    seqs = {id(runner): _three_sequences() for runner in (eager, graphed)}
    for runner in (eager, graphed):
        advance(runner.execute(prefill(seqs[id(runner)])))
    assert capturer.num_captures == 3 and sorted(graphed.graphs.graphs) == [1, 2, 4]
    for ours, reference in zip(graphed.kv_caches, eager.kv_caches):
        assert not ours.needs_scales
        assert torch.equal(ours.k_scale, reference.k_scale) and torch.equal(ours.v_scale, reference.v_scale)
        assert ours.k_scale.item() != 1.0  # calibrated, not the default
    for runner in (eager, graphed):
        for _ in range(2):
            advance(runner.execute(decode(seqs[id(runner)])))
    assert capturer.num_replays == 2
    assert [s.token_ids for s in seqs[id(eager)]] == [s.token_ids for s in seqs[id(graphed)]]


def _three_sequences():
    params = SamplingParams(temperature=0, max_tokens=16)
    return [make_seq(f"r{i}", list(range(3 + i, 8 + 2 * i)), params, first_block=1 + 4 * i) for i in range(3)]


def record_sampled_logits(runner) -> list[torch.Tensor]:
    """From now on, a copy of the logits of every step the runner samples (the list fills as it runs)."""
    sampler, records = runner.sampler, []

    class Recording:
        def sample(self, step_logits, *args):
            records.append(step_logits.clone())
            return sampler.sample(step_logits, *args)

    runner.sampler = Recording()
    return records


def test_graph_replay_pads_rows_and_matches_the_eager_step():
    eager, graphed = tiny_runner(CPU, max_num_seqs=8), tiny_runner(CPU, max_num_seqs=8)
    capturer = EagerCapturer()
    graphed.capture_decode_graphs(max_model_len=64, capturer=capturer)
    assert sorted(graphed.graphs.graphs) == [1, 2, 4, 8] and capturer.num_captures == 4
    eager_seqs, graph_seqs = _three_sequences(), _three_sequences()
    advance(eager.execute(prefill(eager_seqs)))
    advance(graphed.execute(prefill(graph_seqs)))  # prefill: eager in both
    assert capturer.num_replays == 0
    logits = {}
    for runner, seqs in ((eager, eager_seqs), (graphed, graph_seqs)):
        logits[id(runner)] = record_sampled_logits(runner)
        for _ in range(4):
            advance(runner.execute(decode(seqs)))
    assert capturer.num_replays == 4  # every decode step of 3 rows replayed the 4-row graph
    graphs = graphed.graphs
    # Row 3 is padding: no KV write (slot -1), one key, token 0 at position 0.
    assert graphs.slot_mapping[3].item() == -1 and graphs.seq_lens[3].item() == 1
    assert graphs.input_ids[3].item() == 0 and graphs.positions[3].item() == 0
    for a, b in zip(logits[id(eager)], logits[id(graphed)]):
        assert a.shape == b.shape == (3, 96)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert [s.token_ids for s in eager_seqs] == [s.token_ids for s in graph_seqs]
    # Padding wrote only the scratch slot the test backend sends slot -1 to (the last one).
    for (k_eager, v_eager), (k_graph, v_graph) in zip(eager.kv_caches, graphed.kv_caches):
        torch.testing.assert_close(k_eager[:-1], k_graph[:-1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v_eager[:-1], v_graph[:-1], rtol=1e-5, atol=1e-5)


def test_steps_that_are_not_decode_only_or_too_large_run_eagerly():
    runner = tiny_runner(CPU, max_num_seqs=2)
    capturer = EagerCapturer()
    runner.capture_decode_graphs(max_model_len=64, capturer=capturer)
    seqs = _three_sequences()
    advance(runner.execute(prefill(seqs[:2])))
    advance(runner.execute(decode(seqs[:2]) + prefill(seqs[2:])))  # mixed step
    assert capturer.num_replays == 0
    advance(runner.execute(decode(seqs)))  # 3 rows > the largest graph (2)
    assert capturer.num_replays == 0
    advance(runner.execute(decode(seqs[:1])))
    assert capturer.num_replays == 1


@pytest.mark.triton
def test_triton_decode_graphs_read_the_static_buffers_like_the_eager_step():
    """The Triton backend's metadata is views of the packed step (no tensor of its own), so a graph
    captured over the static buffers replays a step of fewer rows (padding: slot -1, one key) with
    the eager step's logits. Under TRITON_INTERPRET=1 (tests/conftest.py), the capture is eager."""
    from batchgen.engine.attention.triton import TritonAttention

    eager = tiny_runner(CPU, max_num_seqs=4, backend_class=TritonAttention)
    graphed = tiny_runner(CPU, max_num_seqs=4, backend_class=TritonAttention)
    capturer = EagerCapturer()
    graphed.capture_decode_graphs(max_model_len=64, capturer=capturer)
    seqs = {id(runner): _three_sequences() for runner in (eager, graphed)}
    logits = {}
    for runner in (eager, graphed):
        advance(runner.execute(prefill(seqs[id(runner)])))
        logits[id(runner)] = record_sampled_logits(runner)
        for _ in range(2):
            advance(runner.execute(decode(seqs[id(runner)])))
    assert capturer.num_replays == 2  # both decode steps of 3 rows replayed the 4-row graph
    assert [s.output_token_ids for s in seqs[id(eager)]] == [s.output_token_ids for s in seqs[id(graphed)]]
    for a, b in zip(logits[id(eager)], logits[id(graphed)]):
        assert a.shape == b.shape == (3, 96)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
