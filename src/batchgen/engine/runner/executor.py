"""The engine's one seam to the model: an Executor loads it, sizes and starts its runner, runs each step.

As vLLM's executors: the engine (llm_engine.py) schedules and calls these methods only; where the
model runs is the executor's business.
- UniprocExecutor: the model in this process, one ModelRunner.
- MultiprocExecutor (engine/parallel/mp_executor.py), `tensor_parallel_size` > 1: this process is
  rank 0 (it schedules, samples and holds a shard), worker processes hold the other shards and run
  every step rank 0 sends them. It runs steps in order only (no `launch` / `collect`: async
  scheduling is off with tensor parallelism, EngineConfig.is_async_scheduling).
"""

from __future__ import annotations

import torch

from batchgen.engine.config import EngineConfig
from batchgen.engine.core.scheduler import ScheduledSeq
from batchgen.engine.core.sequence import Sequence
from batchgen.engine.kv.capacity import kv_bytes_per_token
from batchgen.engine.kv.gpu_memory import GpuMemoryPlan, plan_gpu_kv_cache
from batchgen.engine.loader.model_loader import LoadedModel, load_model
from batchgen.engine.runner.decode_graphs import decode_graph_profiler
from batchgen.engine.runner.model_runner import LaunchedStep, ModelRunner, StepResult


class UniprocExecutor:
    """The model, its KV pool and its runner in this process."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.runner: ModelRunner | None = None  # set by start

    def load_model(self) -> LoadedModel:
        return load_model(self.config)

    def kv_bytes_per_token(self, loaded: LoadedModel) -> int:
        """The bytes one token's K and V take in the pool (every layer)."""
        return kv_bytes_per_token(loaded.model_cfg, self.config.kv_torch_dtype)

    def size_kv_pool_on_gpu(self, loaded: LoadedModel, eos_token_ids: tuple[int, ...],
                            max_model_len: int) -> tuple[int, GpuMemoryPlan]:
        """(KV blocks, the plan) from a profiling step (engine/kv/gpu_memory.py), run by a runner with a
        one-block pool."""
        config = self.config

        def make_runner() -> ModelRunner:
            return ModelRunner(config, loaded.model_cfg, loaded.model, 1, eos_token_ids, loaded.capabilities)

        def profile() -> None:
            make_runner().profile_run(config.max_num_batched_tokens, config.max_num_seqs, max_model_len)
            torch.cuda.synchronize(config.torch_device)

        block_bytes = self.kv_bytes_per_token(loaded) * config.block_size
        min_blocks = -(-max_model_len // config.block_size)
        plan = plan_gpu_kv_cache(config, config.torch_device, loaded.weight_bytes, profile, min_blocks * block_bytes,
                                 profile_graphs=decode_graph_profiler(config, loaded.model_cfg.vocab_size,
                                                                      max_model_len, make_runner))
        return plan.kv_cache // block_bytes, plan

    def start(self, loaded: LoadedModel, num_blocks: int, eos_token_ids: tuple[int, ...], max_model_len: int) -> None:
        """The runner over a pool of `num_blocks`; on CUDA its decode graphs (unless enforce_eager)."""
        config = self.config
        self.runner = ModelRunner(config, loaded.model_cfg, loaded.model, num_blocks, eos_token_ids,
                                  loaded.capabilities)
        if config.torch_device.type == "cuda" and not config.enforce_eager and not self.runner.is_pooling:
            self.runner.capture_decode_graphs(max_model_len)  # a pooling model never decodes

    def execute(self, scheduled: list[ScheduledSeq], num_live_seqs: int,
                blocks_to_copy: list[tuple[int, int]] | None = None) -> list[StepResult]:
        return self.runner.execute(scheduled, num_live_seqs, blocks_to_copy)

    def launch(self, scheduled: list[ScheduledSeq], num_live_seqs: int,
               blocks_to_copy: list[tuple[int, int]] | None = None) -> LaunchedStep:
        """Async scheduling: queue a plain step on the device; `collect` waits for its results."""
        return self.runner.launch(scheduled, num_live_seqs, blocks_to_copy)

    def collect(self, launched: LaunchedStep) -> list[StepResult]:
        return self.runner.collect(launched)

    def release(self, seq: Sequence) -> None:
        self.runner.release(seq)

    def report(self) -> dict | None:
        """Tensor parallelism's figures per rank (None: one process)."""
        return None

    def shutdown(self) -> None:
        """Nothing to stop in one process."""


def make_executor(config: EngineConfig) -> UniprocExecutor:
    """The executor `config.tensor_parallel_size` asks for (the multiprocess one starts its workers now)."""
    if config.tensor_parallel_size == 1:
        return UniprocExecutor(config)
    from batchgen.engine.parallel.mp_executor import MultiprocExecutor

    return MultiprocExecutor(config)
