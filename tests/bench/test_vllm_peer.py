"""The vLLM peer's plumbing with a stand-in for vLLM (no vLLM in CI; the real one runs in the benchmark):
the command line and environment it is started with, the request it reads, the result it writes and
how the bench turns that into the peer's run; and the errors that name `make vllm-peer`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from batchgen.bench.options import BenchOptions
from batchgen.bench.peers import vllm_cpu
from batchgen.bench.peers.vllm_cpu import VllmPeerConfig, VllmPeerUnavailable, request_document, run_vllm_peer
from batchgen.bench.workloads import BenchRequest, Workload
from batchgen.cli.bench import bench_command

# Writes what vllm_driver.py writes, from the request it was given: output token = prompt's first id + i.
STAND_IN = r'''
import argparse, json, os, sys
parser = argparse.ArgumentParser()
parser.add_argument("--request"); parser.add_argument("--result")
args = parser.parse_args()
request = json.load(open(args.request))
outputs = {r["request_id"]: [r["prompt_token_ids"][0] + i for i in range(r["output_len"])] for r in request["requests"]}
reps = [{"seconds": s, "num_prompt_tokens": sum(len(r["prompt_token_ids"]) for r in request["requests"]),
         "num_completion_tokens": sum(map(len, outputs.values()))} for s in (2.0, 1.5)[:request["num_reps"]]]
env = {k: os.environ.get(k) for k in ("VLLM_TARGET_DEVICE", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")}
json.dump({"load_seconds": 12.0, "warmup_seconds": 0.5, "reps": reps, "output_token_ids": outputs,
           "dtype": request["dtype"], "versions": {"vllm": "stand-in"},
           "settings": {"argv": sys.argv[1:], "env": env, "request": {k: v for k, v in request.items() if k != "requests"}}},
          open(args.result, "w"))
'''

WORKLOAD = Workload("random", [BenchRequest("a", [5, 6, 7], 4), BenchRequest("b", [9, 10], 2)])


def stand_in_config(tmp_path: Path, **kwargs) -> VllmPeerConfig:
    driver = tmp_path / "driver.py"
    driver.write_text(STAND_IN)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    return VllmPeerConfig(model_dir=model_dir, python=Path(sys.executable), driver=driver, **kwargs)


@pytest.mark.subprocess
def test_the_peer_gets_the_workload_and_vllm_settings_and_its_fastest_rep_is_reported(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    config = stand_in_config(tmp_path, dtype="bfloat16", num_threads=2, kv_cache_gib=3, num_reps=2,
                             max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=300)
    run = run_vllm_peer(config, WORKLOAD)
    assert run.name == "vllm-cpu" and run.seconds == 1.5  # the faster repetition
    assert run.num_prompt_tokens == 5 and run.num_completion_tokens == 6
    assert run.output_token_ids == {"a": [5, 6, 7, 8], "b": [9, 10]}
    assert run.details["load_seconds"] == 12.0 and [r["seconds"] for r in run.details["reps"]] == [2.0, 1.5]
    seen = run.details["settings"]
    assert seen["argv"][0] == "--request" and seen["argv"][2] == "--result"
    assert seen["env"] == {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "3", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    assert {k: v for k, v in run.details["env"].items() if k != "LD_PRELOAD"} == seen["env"]
    assert seen["request"] == {"model_dir": str(config.model_dir), "dtype": "bfloat16", "seed": 0, "max_num_seqs": 64,
                               "max_num_batched_tokens": 2048, "max_model_len": 300, "num_reps": 2}
    document = request_document(config, WORKLOAD)
    assert document["requests"][1] == {"request_id": "b", "prompt_token_ids": [9, 10], "output_len": 2}
    # vLLM's settings already in the environment win over the bench's defaults.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    assert run_vllm_peer(config, WORKLOAD).details["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "0"


def test_without_a_thread_count_vllm_binds_its_threads_as_it_does_for_a_user(tmp_path, monkeypatch):
    # vLLM's default (auto) is what `vllm.LLM` gives a user; the bench pins cores only when given --threads.
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    model_dir = tmp_path / "model"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in VllmPeerConfig(model_dir, tmp_path / "python").environment()
    assert VllmPeerConfig(model_dir, tmp_path / "python", num_threads=3).environment()[
        "VLLM_CPU_OMP_THREADS_BIND"] == "0-2"
    # An HF folder is loaded as it is (no conversion): the MoE bench model, a user's folder.
    (model_dir).mkdir()
    (model_dir / "config.json").write_text("{}")
    monkeypatch.delenv(vllm_cpu.MODEL_DIR_VARIABLE, raising=False)
    assert vllm_cpu.default_model_dir(str(model_dir)) == model_dir


def test_the_matrix_runs_the_bench_command_and_pins_threads_only_when_asked(tmp_path):
    from batchgen.bench.cpu_matrix import bench_command

    command = bench_command("random", "float32", tmp_path / "r.json")
    assert command[1:5] == ["-m", "batchgen.cli.main", "bench", "--workload"] and "--threads" not in command
    pinned = bench_command("chat", "bfloat16", tmp_path / "c.json", num_threads=2, num_requests=16,
                           engine_settings=("kv_cache_memory=512MiB",))
    assert pinned[pinned.index("--threads") + 1] == "2" and pinned[pinned.index("--num-requests") + 1] == "16"
    assert pinned[pinned.index("--engine") + 1] == "kv_cache_memory=512MiB"


@pytest.mark.subprocess
def test_a_missing_environment_or_model_or_output_is_a_clear_error(tmp_path, monkeypatch):
    config = stand_in_config(tmp_path)
    with pytest.raises(VllmPeerUnavailable, match="no vLLM environment at .*make vllm-peer"):
        run_vllm_peer(VllmPeerConfig(model_dir=config.model_dir, python=tmp_path / "venv" / "bin" / "python"),
                      WORKLOAD)
    with pytest.raises(VllmPeerUnavailable, match="no converted model at .*make vllm-peer"):
        run_vllm_peer(VllmPeerConfig(model_dir=tmp_path / "none", python=Path(sys.executable)), WORKLOAD)
    short = Workload("random", [*WORKLOAD.requests, BenchRequest("c", [1], 1)])
    config.driver.write_text(STAND_IN.replace('for r in request["requests"]}', 'for r in request["requests"][:2]}', 1))
    with pytest.raises(VllmPeerUnavailable, match="no output for 1 requests, e.g. c"):
        run_vllm_peer(config, short)
    config.driver.write_text("import sys; print('vllm exploded'); sys.exit(3)")
    with pytest.raises(VllmPeerUnavailable, match="(?s)exit 3.*vllm exploded"):
        run_vllm_peer(config, WORKLOAD)


def test_the_default_paths_follow_the_cache_root_and_their_variables(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(vllm_cpu.VENV_VARIABLE, raising=False)
    monkeypatch.delenv(vllm_cpu.MODEL_DIR_VARIABLE, raising=False)
    assert vllm_cpu.default_venv() == tmp_path / "vllm-cpu-venv"
    assert vllm_cpu.default_model_dir("smollm2-135m-instruct") == tmp_path / "peer-models" / "smollm2-135m-instruct-hf"
    monkeypatch.setenv(vllm_cpu.VENV_VARIABLE, str(tmp_path / "v"))
    assert VllmPeerConfig.for_model("x").python == tmp_path / "v" / "bin" / "python"
    assert vllm_cpu.kv_cache_gib(256 * 2**20) == 1 and vllm_cpu.kv_cache_gib(4 * 2**30 + 1) == 5


def test_peer_and_dtype_options_are_checked_before_any_loading(tmp_path, monkeypatch):
    monkeypatch.setenv(vllm_cpu.VENV_VARIABLE, str(tmp_path / "no-venv"))
    app = typer.Typer()
    app.command()(bench_command)
    for args, message in [(["--peer", "vlm"], "--peer must be one of hf, vllm, none"),
                          (["--dtype", "float16"], "--dtype must be one of float32, bfloat16, auto"),
                          (["--peer", "vllm", "--workload", "copy"], "--peer vllm runs the random, chat"),
                          (["--peer", "vllm"], "no vLLM environment at")]:
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2 and message in result.output, (args, result.output)
    assert BenchOptions(workload="shared-prefix").peer_kind == "none"
    assert BenchOptions().peer_kind == "hf" and not BenchOptions(peer="none").is_peer


def test_the_driver_is_shipped_and_imports_only_vllm_and_the_standard_library():
    import ast

    tree = ast.parse(vllm_cpu.DRIVER.read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= {"__future__", "argparse", "json", "time", "torch", "transformers", "vllm"}


def test_the_matrix_summary_takes_medians_over_rounds(tmp_path):
    import json

    from batchgen.bench.cpu_matrix import summarize

    for round_index, (ours, theirs) in enumerate([(100.0, 50.0), (120.0, 40.0), (90.0, 60.0)], start=1):
        result = {"engine_runs": {"engine": {"completion_tokens_per_s": ours}}, "peer": {"completion_tokens_per_s": theirs},
                  "ratio_vs_peer": ours / theirs, "fraction_of_roofline": 0.5,
                  "machine": {"cpu": "Test CPU", "num_threads": 4, "num_cpus": 4},
                  "agreement": {"engine vs peer": {"num_exact": 64, "num_requests": 64}},
                  "kernels": {"cpu_isa": "avx2", "bf16_path": None}}
        (tmp_path / f"random-float32-vllm-r{round_index}.json").write_text(json.dumps(result))
    table = summarize(tmp_path)
    assert "Test CPU, kernels at avx2; batchgen 4 torch threads of 4 CPUs, vLLM OpenMP binding auto" in table
    assert "| random | float32 (float32) | 100.0 (90.0-120.0) | 50.0 (40.0-60.0) | 2.00x | 64/64 | 50.0% | 3 |" in table


def test_the_roofline_gemm_rate_is_measured_in_the_dtype_the_gemms_compute_in():
    import torch

    from batchgen.bench.harness import gemm_compute_dtype

    assert gemm_compute_dtype({"compute_dtype": "bfloat16", "bf16_path": "bf16_units"}) == torch.bfloat16
    assert gemm_compute_dtype({"compute_dtype": "float32", "bf16_path": "widened"}) == torch.float32
    assert gemm_compute_dtype({"compute_dtype": "float32"}) == torch.float32
