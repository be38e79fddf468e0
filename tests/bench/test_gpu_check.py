"""batchgen.bench.gpu_check: its whole flow at toy sizes on the CPU, with its arithmetic checked."""

from __future__ import annotations

import json
import subprocess
import sys
import weakref

import pytest
import torch

from batchgen.bench import gpu_check
from batchgen.bench.gpu_check import speed
from batchgen.bench.gpu_check.models import seeded_init, tiny_config
from batchgen.engine.core.llm_engine import LLMEngine
from batchgen.engine.kv.gpu_memory import plan_gpu_kv_cache
from batchgen.engine.loader.model_loader import build_loaded_model


class TickClock:
    """A stand-in for perf_counter: each call is one second after the last."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


@pytest.mark.triton
def test_tiny_run_on_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    args = gpu_check.parse_args(["--tiny", "--quiet", "--device", "cpu", "--out", str(out),
                                 "--config-time-limit", "1e9", "--time-budget", "1e9"])
    args.clock = TickClock()
    result = gpu_check.run(args)
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))  # the file holds the last record
    correctness = result["correctness"]
    assert correctness["ok"] and correctness["float32"]["identical_requests"] == correctness["num_prompts"]
    assert correctness["bfloat16"]["num_tokens"] == correctness["num_prompts"] * correctness["num_tokens"]
    assert all(r["ok"] for r in result["fp8_matmuls"])
    speed = result["speed"]
    assert 1 <= len(speed) <= 8 and speed[-1]["name"].startswith("fp8 weights")
    for row in speed:
        if "skipped" in row:  # a setting this build lacks (FP8 KV before its backend lands) says so
            assert row["name"].startswith("fp8 KV") and "kv_cache_dtype" in row["skipped"]
            continue
        assert row["completion_tokens"] == row["num_requests"] * row["output_len"]
        # The tick clock: the whole run spans 2 ticks per step plus 2; tok/s follows from it exactly.
        assert row["completion_tokens_per_s"] == row["completion_tokens"] / row["seconds"]
        assert row["decode_steps"] >= 1 and row["decode_tokens_per_s"] > 0
        assert row["decode_fraction_of_roofline"] > 0
    assert result["peer"]["completion_tokens"] == result["peer"]["batch_size"] * result["peer"]["output_len"]
    # Kernels: attention runs here under the interpreter (tests set TRITON_INTERPRET=1), split and
    # unsplit giving the same bits; the sampler's settings over greedy.
    attention = result["kernels"]["decode_attention"]
    assert [r["num_splits"] for r in attention] == [2, 3]
    assert all(r["split_equals_unsplit_bitwise"] and r["unsplit_gb_per_s"] > 0 for r in attention)
    assert set(result["kernels"]["sampler"]["over_greedy"]) == {"top-k 50 + top-p 0.9", "top-p 0.9"}
    assert set(result["part_seconds"]) == {"correctness", "fp8_matmuls", "kernels", "speed", "peer"}
    table = gpu_check.format_table(result)
    assert all(row["name"] in table for row in speed) and "HF generate" in table
    assert "decode attention S=2 at 64" in table and "sampler N=8" in table


@pytest.mark.subprocess
def test_it_imports_without_pydantic_polars_or_gguf():
    """`pip install --no-deps -e .` on a GPU image: torch, triton and transformers only."""
    code = ("import sys\n"
            "for name in ('pydantic', 'polars', 'gguf', 'pyarrow', 'yaml', 'typer', 'fsspec'):\n"
            "    sys.modules[name] = None\n"
            "import batchgen.bench.gpu_check as g\n"
            "g.parse_args(['--tiny'])\n"
            "assert g.parse_args(['--tensor-parallel-size', '2']).tensor_parallel_size == 2\n")
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


# ---- the speed loop on a device whose memory the live engines fill ----------------------------------
GiB = 2**30


class FakeDeviceMemory:
    """torch.cuda's memory queries over a made-up 141 GiB device: free memory is what the live models
    and engines leave (each held until the collector frees it), as on an H200 where the KV pool of an
    engine still referenced is still allocated."""

    def __init__(self, monkeypatch):
        self.total, self.context = 141 * GiB, GiB // 2
        self.held: dict[int, int] = {}
        self.num_empty_cache = 0
        for name in ("mem_get_info", "memory_allocated", "max_memory_allocated", "reset_peak_memory_stats",
                     "empty_cache", "is_available"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))

    def hold(self, owner, num_bytes: int) -> None:
        self.held[id(owner)] = num_bytes
        weakref.finalize(owner, self.held.pop, id(owner), None)

    def mem_get_info(self, device=None):
        return self.total - self.context - sum(self.held.values()), self.total

    def memory_allocated(self, device=None):
        return sum(self.held.values())

    max_memory_allocated = memory_allocated

    def reset_peak_memory_stats(self, device=None):
        pass

    def empty_cache(self):
        self.num_empty_cache += 1

    def is_available(self):
        return True


def engines_sized_on(memory: FakeDeviceMemory, monkeypatch, failing: str | None = None) -> list[dict]:
    """Run the speed loop over 3 tiny configurations; each engine first sizes a KV pool of an 8B model
    on the fake device (engine/kv/gpu_memory.py's arithmetic) and holds it while it lives; the model
    holds 16 GiB. `failing`: the configuration whose engine raises once its pool is allocated."""

    class SizedEngine(LLMEngine):
        def __init__(self, config, **kwargs):
            plan = plan_gpu_kv_cache(config.replace(num_kv_blocks=None), torch.device("cuda"), 16 * GiB,
                                     lambda: None, min_kv_bytes=GiB)
            memory.hold(self, plan.kv_cache)
            self.sized_kv_bytes = plan.kv_cache
            if config.max_num_seqs == failing:
                raise RuntimeError("graph capture failed")
            super().__init__(config, **kwargs)

    def build_model(*args, **kwargs):
        loaded = build_loaded_model(*args, **kwargs)
        memory.hold(loaded, 16 * GiB)
        return loaded

    monkeypatch.setattr(speed, "LLMEngine", SizedEngine)  # the speed loop's engines and model
    monkeypatch.setattr(speed, "build_loaded_model", build_model)
    args = gpu_check.parse_args(["--tiny", "--quiet", "--device", "cpu", "--out", "", "--max-configs", "3"])
    rows: list[dict] = []
    speed.run_speed(args, torch.device("cpu"), lambda r: rows.__setitem__(slice(None), list(r)))
    return rows


def test_every_speed_configuration_gets_the_memory_the_last_one_gave_back(monkeypatch):
    memory = FakeDeviceMemory(monkeypatch)
    rows = engines_sized_on(memory, monkeypatch)
    assert [r["name"] for r in rows] == [c.name for c in speed.speed_configs(tiny=True)[:3]]
    for row in rows:
        assert "error" not in row, row.get("traceback")
        assert row["completion_tokens"] == row["num_requests"] * row["output_len"]
    assert memory.held == {} and memory.num_empty_cache >= 3  # everything given back at the end


def test_a_failing_configuration_is_recorded_and_the_next_runs(monkeypatch):
    memory = FakeDeviceMemory(monkeypatch)
    second = speed.speed_configs(tiny=True)[1]
    rows = engines_sized_on(memory, monkeypatch, failing=second.max_num_seqs)
    assert len(rows) == 3 and "graph capture failed" in rows[1]["error"] and "Traceback" in rows[1]["traceback"]
    for row in (rows[0], rows[2]):  # the third sized its pool with the failed engine's memory given back
        assert "error" not in row, row.get("traceback")
        assert row["completion_tokens"] == row["num_requests"] * row["output_len"]
    assert memory.held == {}


def test_a_configuration_past_its_time_limit_is_cut_short():
    engine_args = gpu_check.parse_args(["--tiny", "--quiet", "--device", "cpu"])
    sc = speed.speed_configs(tiny=True)[1]
    config = speed.speed_engine_config(sc, engine_args, torch.device("cpu"), torch.float32, 64)
    loaded = build_loaded_model(config, tiny_config(), 64, seeded_init(0, torch.device("cpu")))
    engine = LLMEngine(config, loaded=loaded)
    row = speed.run_speed_config(engine, sc, seed=1, clock=TickClock(), time_limit=5)  # ~2 ticks a step
    assert row["stopped_at_time_limit"] == 5 and not engine.has_unfinished()
    assert 0 < row["completion_tokens"] < row["num_requests"] * row["output_len"]
