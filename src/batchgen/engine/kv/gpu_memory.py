"""KV pool sizing on CUDA, as vLLM and nano-vllm do it: measure one step's peak, give the KV the rest.

After the weights are loaded: empty torch's cache, note what the device already holds (this
engine's weights, the CUDA context, other engines in the process, other processes), run one
profiling step at its largest (max_num_batched_tokens tokens, the sampler over max_num_seqs rows)
and read the allocator's peak above what was allocated before. Then

    KV bytes = gpu_memory_utilization x total - held before profiling - peak activations - CUDA graphs

where the CUDA graphs' share (captured after the pool is allocated) is the peak of one eager decode
step at the largest graph size (what the graphs' shared pool holds) plus the buffers they read; so a
second engine in the same process gets what the first left under the same cap, or a clear
error. An explicit `kv_cache_memory` (bytes, or a fraction of the free memory) wins over
gpu_memory_utilization, and is checked against what is free.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchgen.engine.config import EngineConfig, parse_memory_size

log = logging.getLogger("batchgen.engine")

GiB = 2**30


@dataclass(frozen=True)
class GpuMemoryPlan:
    """What the sizing saw and decided, in bytes (logged, and kept on the engine)."""

    total: int
    free_before_profile: int
    weights: int  # this engine's (from its tensors)
    peak_activations: int
    kv_cache: int
    rule: str  # "gpu_memory_utilization" | "kv_cache_memory"
    cuda_graphs: int = 0  # reserved for the decode graphs' pool and buffers (0: enforce_eager)

    @property
    def held_before_profile(self) -> int:
        return self.total - self.free_before_profile

    def describe(self) -> str:
        return (f"total {self.total / GiB:.2f} GiB, held before profiling {self.held_before_profile / GiB:.2f} GiB "
                f"(weights {self.weights / GiB:.2f} GiB), peak activations {self.peak_activations / GiB:.2f} GiB, "
                f"CUDA graphs {self.cuda_graphs / GiB:.2f} GiB -> KV {self.kv_cache / GiB:.2f} GiB ({self.rule})")


def plan_gpu_kv_cache(config: EngineConfig, device: torch.device, weight_bytes: int, profile: Callable[[], None],
                      min_kv_bytes: int, cuda=torch.cuda,
                      profile_graphs: Callable[[], int] | None = None) -> GpuMemoryPlan:
    """Run `profile` (one largest step) and size the KV pool; `min_kv_bytes`: the least that is any
    use (max_model_len tokens). Raises ValueError, with the arithmetic, when less would remain.
    `profile_graphs` (None: no CUDA graphs): run the largest decode graph's step eagerly and return
    the bytes of the graphs' buffers outside their pool; its peak plus those are reserved.
    `cuda` is torch.cuda (tests pass a stand-in with mem_get_info and the memory stats)."""
    cuda.empty_cache()
    free, total = cuda.mem_get_info(device)
    allocated_before = cuda.memory_allocated(device)
    cuda.reset_peak_memory_stats(device)
    profile()
    peak = max(cuda.max_memory_allocated(device) - allocated_before, 0)
    cuda.empty_cache()
    graphs = 0
    if profile_graphs is not None:
        cuda.reset_peak_memory_stats(device)
        static = profile_graphs()
        graphs = max(cuda.max_memory_allocated(device) - allocated_before, 0) + static
        cuda.empty_cache()
    setting = config.kv_cache_memory
    held = total - free
    if setting != "auto":
        value = parse_memory_size(setting)
        kv = int(free * value) if isinstance(value, float) else int(value)
        room = free - peak - graphs
        rule = "kv_cache_memory"
        if kv > room:
            raise ValueError(
                f"engine.kv_cache_memory {setting!r} asks for {kv / GiB:.2f} GiB of KV cache, but only "
                f"{room / GiB:.2f} GiB is free once this engine's step activations ({peak / GiB:.2f} GiB) and "
                f"CUDA graphs ({graphs / GiB:.2f} GiB) are counted ({free / GiB:.2f} GiB free of "
                f"{total / GiB:.2f} GiB): lower kv_cache_memory")
    else:
        util = config.gpu_memory_utilization
        kv = int(util * total) - held - peak - graphs
        rule = "gpu_memory_utilization"
        if kv < min_kv_bytes:
            others = max(held - weight_bytes, 0)
            raise ValueError(
                f"no room for the KV cache: engine.gpu_memory_utilization {util} x {total / GiB:.2f} GiB = "
                f"{util * total / GiB:.2f} GiB, of which the device already holds {held / GiB:.2f} GiB "
                f"(this engine's weights {weight_bytes / GiB:.2f} GiB; other engines, processes and the CUDA "
                f"context {others / GiB:.2f} GiB), one step's activations take {peak / GiB:.2f} GiB and the "
                f"CUDA graphs {graphs / GiB:.2f} GiB, leaving {kv / GiB:.2f} GiB; the KV cache needs at least "
                f"{min_kv_bytes / GiB:.3f} GiB (max_model_len tokens). Raise gpu_memory_utilization, lower "
                f"max_num_batched_tokens, max_model_len or max_cuda_graph_size, free the other engines, or set "
                f"kv_cache_memory")
    plan = GpuMemoryPlan(total=total, free_before_profile=free, weights=weight_bytes, peak_activations=peak,
                         kv_cache=kv, rule=rule, cuda_graphs=graphs)
    log.info("GPU memory: %s", plan.describe())
    return plan
