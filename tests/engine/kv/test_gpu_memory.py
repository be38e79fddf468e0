"""KV pool sizing on CUDA with torch.cuda's memory queries mocked: the arithmetic, the override, the error."""

from __future__ import annotations

import pytest
import torch

from batchgen.engine.config import EngineConfig
from batchgen.engine.kv.gpu_memory import plan_gpu_kv_cache

GiB = 2**30
DEVICE = torch.device("cuda:0")


class FakeGpu:
    """torch.cuda's memory functions over a made-up device; `profile` allocates `activations` bytes."""

    def __init__(self, monkeypatch, total: float, free: float, allocated: float, activations: float):
        self.total, self.free, self.allocated = int(total * GiB), int(free * GiB), int(allocated * GiB)
        self.peak = self.allocated
        self.activations = int(activations * GiB)
        self.calls: list[str] = []
        for name in ("mem_get_info", "memory_allocated", "max_memory_allocated", "reset_peak_memory_stats",
                     "empty_cache"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))

    def mem_get_info(self, device=None):
        self.calls.append("mem_get_info")
        return self.free, self.total

    def memory_allocated(self, device=None):
        return self.allocated

    def max_memory_allocated(self, device=None):
        self.calls.append("max_memory_allocated")
        return self.peak

    def reset_peak_memory_stats(self, device=None):
        self.calls.append("reset_peak_memory_stats")
        self.peak = self.allocated

    def empty_cache(self):
        self.calls.append("empty_cache")

    def profile(self):
        self.calls.append("profile")
        self.peak = self.allocated + self.activations


def plan(gpu: FakeGpu, weights: float = 16, min_kv: float = 0.001, **settings):
    config = EngineConfig(model="m", **settings)
    return plan_gpu_kv_cache(config, DEVICE, int(weights * GiB), gpu.profile, int(min_kv * GiB))


def test_kv_gets_the_utilization_share_less_what_is_held_and_the_profiled_peak(monkeypatch):
    # 100 GiB device; 20 GiB held after loading (16 GiB weights + context); the step peaks 3 GiB above.
    gpu = FakeGpu(monkeypatch, total=100, free=80, allocated=16, activations=3)
    result = plan(gpu)
    assert result.kv_cache == int(0.9 * 100 * GiB) - 20 * GiB - 3 * GiB
    assert result.peak_activations == 3 * GiB and result.rule == "gpu_memory_utilization"
    assert gpu.calls == ["empty_cache", "mem_get_info", "reset_peak_memory_stats", "profile",
                         "max_memory_allocated", "empty_cache"]
    assert plan(FakeGpu(monkeypatch, 100, 80, 16, 3), gpu_memory_utilization=0.5).kv_cache == 27 * GiB


def test_kv_cache_memory_wins_over_the_utilization_and_is_checked_against_free_memory(monkeypatch):
    assert plan(FakeGpu(monkeypatch, 100, 80, 16, 3), kv_cache_memory="10GiB").kv_cache == 10 * GiB
    fraction = plan(FakeGpu(monkeypatch, 100, 80, 16, 3), kv_cache_memory=0.5, gpu_memory_utilization=0.2)
    assert fraction.kv_cache == 40 * GiB and fraction.rule == "kv_cache_memory"
    with pytest.raises(ValueError, match=r"kv_cache_memory '78GiB' asks for 78.00 GiB .* only 77.00 GiB is free"):
        plan(FakeGpu(monkeypatch, 100, 80, 16, 3), kv_cache_memory="78GiB")


def test_a_second_engine_gets_what_is_left_or_a_clear_error(monkeypatch):
    # The first engine took its KV: 85 GiB held now, of which 16 GiB are the second engine's own weights.
    second = plan(FakeGpu(monkeypatch, total=100, free=15, allocated=80, activations=2))
    assert second.kv_cache == 90 * GiB - 85 * GiB - 2 * GiB
    with pytest.raises(ValueError) as error:
        plan(FakeGpu(monkeypatch, total=100, free=11, allocated=80, activations=2), min_kv=1)
    message = str(error.value)
    assert "gpu_memory_utilization 0.9 x 100.00 GiB = 90.00 GiB" in message
    assert "already holds 89.00 GiB" in message and "weights 16.00 GiB" in message
    assert "other engines, processes and the CUDA context 73.00 GiB" in message
    assert "activations take 2.00 GiB" in message and "leaving -1.00 GiB" in message
    assert "set kv_cache_memory" in message


def test_gpu_memory_utilization_is_a_fraction():
    with pytest.raises(ValueError, match="gpu_memory_utilization must be a fraction in"):
        EngineConfig(model="m", gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(model="m", gpu_memory_utilization=0)


def test_the_profiling_step_runs_at_full_size_on_a_one_block_pool():
    """ModelRunner.profile_run: max_num_batched_tokens over max_num_seqs sampling prompts, all KV in block 0."""
    from tests.engine.step_fixtures import tiny_runner

    runner = tiny_runner(torch.device("cpu"), num_blocks=1)
    seen = []
    sampler = runner.sampler

    class Recording:
        def sample(self, logits, batch, seqs, penalties):
            seen.append((tuple(logits.shape), len(batch.random_rows)))
            return sampler.sample(logits, batch, seqs, penalties)

    runner.sampler = Recording()
    runner.profile_run(num_tokens=100, num_seqs=8, max_model_len=256)
    assert seen == [((8, 96), 8)]  # every row samples, through the random (top-k/top-p) path
    runner.profile_run(num_tokens=600, num_seqs=1, max_model_len=256)  # longer than one sequence may be
    assert seen[-1][0] == (3, 96)


def test_the_cuda_graphs_pool_is_reserved_before_the_kv_pool(monkeypatch):
    """With graphs (not enforce_eager), the largest graph's eager decode step peaks 1.5 GiB above what was
    allocated and its buffers take 0.5 GiB more: the KV pool gives up those 2 GiB."""
    gpu = FakeGpu(monkeypatch, total=100, free=80, allocated=16, activations=3)

    def profile_graphs() -> int:
        gpu.calls.append("profile_graphs")
        gpu.peak = gpu.allocated + int(1.5 * GiB)
        return GiB // 2

    config = EngineConfig(model="m")
    result = plan_gpu_kv_cache(config, DEVICE, 16 * GiB, gpu.profile, GiB // 1000, profile_graphs=profile_graphs)
    assert result.cuda_graphs == 2 * GiB and result.peak_activations == 3 * GiB
    assert result.kv_cache == int(0.9 * 100 * GiB) - 20 * GiB - 3 * GiB - 2 * GiB
    assert gpu.calls.index("profile_graphs") > gpu.calls.index("profile")
    assert "CUDA graphs 2.00 GiB -> KV 65.00 GiB" in result.describe()
    gpu = FakeGpu(monkeypatch, total=100, free=80, allocated=16, activations=3)
    with pytest.raises(ValueError, match=r"only 75.00 GiB is free .* CUDA graphs \(2.00 GiB\)"):
        plan_gpu_kv_cache(EngineConfig(model="m", kv_cache_memory="76GiB"), DEVICE, 16 * GiB, gpu.profile, 1,
                          profile_graphs=profile_graphs)


def test_the_graph_profiling_step_is_the_largest_decode_graph():
    """ModelRunner.profile_decode_graph: num_seqs one-token decodes over block 0, the model alone (no sampler)."""
    from tests.engine.step_fixtures import tiny_runner

    runner = tiny_runner(torch.device("cpu"), num_blocks=1)
    shapes = []
    forward = runner.model.forward
    runner.model.forward = lambda ids, positions, *rest: shapes.append((ids.shape, positions.tolist())) or forward(
        ids, positions, *rest)
    runner.sampler = None  # never called
    runner.profile_decode_graph(8)
    assert shapes == [((8,), [1] * 8)]
