"""A tensor-parallel worker follows rank 0 step for step where CUDA graphs are involved: it captures
after the same step as rank 0 (FP8 KV scales calibrated by the first real step) and sizes its KV pool
around the same two profiling steps rank 0 sends (the largest step, then the largest decode graph's),
so the graphs' memory is reserved on every rank. torch.cuda's memory queries are mocked."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from batchgen.engine.config import EngineConfig
from batchgen.engine.parallel.worker import STEP, STEP_HEADER_INTS, Worker

GiB = 2**30
WORKSPACE_BYTES = 3 * 2**20


class RecordingRunner:
    def __init__(self, calls: list):
        self.calls = calls
        self.windowed = None  # no sliding-window block group (kv/window_groups.py)
        self.attention = SimpleNamespace(build_packed=lambda step: "meta",
                                         graph_workspace_bytes=lambda sizes, max_model_len: WORKSPACE_BYTES)

    def attention_metadata(self, step):  # the model runner's: the backend's packed metadata (and window tables)
        return self.attention.build_packed(step)

    def forward(self, step, meta):
        self.calls.append("forward")

    def capture_if_pending(self):
        self.calls.append("capture_if_pending")


def step_header() -> np.ndarray:
    return np.array([STEP] + [0] * (STEP_HEADER_INTS - 1), dtype=np.int32)


def bare_worker(config: EngineConfig, headers: list[np.ndarray]) -> tuple[Worker, list]:
    worker = object.__new__(Worker)
    sent: list = []
    worker.config = config
    worker.conn = SimpleNamespace(send=sent.append)
    worker.loaded = SimpleNamespace(weight_bytes=GiB, model_cfg=SimpleNamespace(vocab_size=1000))
    worker.kv_bytes_per_token = 1024
    worker.next_header = lambda: headers.pop(0)
    return worker, sent


def test_the_worker_captures_after_the_step_it_runs(monkeypatch):
    from batchgen.engine.runner import step_inputs

    monkeypatch.setattr(step_inputs, "unpack_model_sections", lambda *args: {})
    monkeypatch.setattr(step_inputs, "make_step_inputs", lambda *args: "step")
    worker, _ = bare_worker(EngineConfig(model="m"), [])
    worker.buffer = torch.zeros(4, dtype=torch.int32)
    worker.parallel = SimpleNamespace(group=SimpleNamespace(broadcast=lambda tensor: tensor))
    calls: list = []
    worker.run_step(step_header(), RecordingRunner(calls))
    assert calls == ["forward", "capture_if_pending"]


class FakeCuda:
    """torch.cuda's memory functions: each profiling step run peaks `step_bytes` above what is held."""

    def __init__(self, monkeypatch, step_bytes: int):
        self.total, self.held, self.peak, self.step_bytes = 80 * GiB, 2 * GiB, 2 * GiB, step_bytes
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (self.total - self.held, self.total))
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.held)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: setattr(self, "peak", self.held))
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    def run(self):
        self.peak = self.held + self.step_bytes


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_the_worker_sizes_its_pool_around_rank_0s_profiling_steps(monkeypatch, enforce_eager):
    cuda = FakeCuda(monkeypatch, step_bytes=GiB)
    config = EngineConfig(model="m", enforce_eager=enforce_eager, max_num_seqs=64)
    headers = [step_header() for _ in range(3)]  # one more than either case may take
    worker, sent = bare_worker(config, headers)
    calls: list = []
    runners: list = []

    def make_runner(num_blocks):
        runners.append(num_blocks)
        return RecordingRunner(calls)

    monkeypatch.setattr(worker, "make_runner", make_runner)
    monkeypatch.setattr(worker, "run_step", lambda header, runner: (calls.append("step"), cuda.run()))
    worker.profile(max_model_len=256)
    num_steps = 1 if enforce_eager else 2  # rank 0 sends the decode graph's step unless eager
    assert calls.count("step") == num_steps and len(headers) == 3 - num_steps
    assert set(runners) == {1}
    ((kind, answer),) = sent
    block_bytes = worker.kv_bytes_per_token * config.block_size
    kv = int(0.9 * cuda.total) - cuda.held - GiB  # the profiled step's peak
    if not enforce_eager:
        from batchgen.engine.runner.decode_graphs import DecodeGraphs

        static = DecodeGraphs.static_bytes(config.num_cuda_graph_seqs, 256, config.block_size, 1000)
        kv -= GiB + static + WORKSPACE_BYTES  # the graph step's peak and the graphs' own buffers
    assert kind == "profiled" and answer == {"num_blocks": kv // block_bytes}
