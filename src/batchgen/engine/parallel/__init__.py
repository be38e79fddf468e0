"""Tensor parallelism: one model over several ranks (GPUs through NCCL, CPU processes through gloo).

- layout.py: which heads, MLP channels and vocabulary rows each rank holds, and each checkpoint
  tensor's slice for a rank;
- group.py: the collectives (all-reduce, the logits gather, the step broadcast) with timeouts;
- shards.py: reading only a rank's slice of safetensors, GGUF and integer weights;
- worker.py: a worker process (ranks 1..N-1): its shard, its KV pool, the steps rank 0 sends;
- mp_executor.py: rank 0's side (engine/runner/executor.py is the interface the engine calls).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from batchgen.engine.parallel.group import TensorParallelGroup
from batchgen.engine.parallel.layout import TensorParallelLayout


@dataclass
class TensorParallel:
    """What one rank's model needs: its slice of the model and the group it runs with."""

    layout: TensorParallelLayout
    group: TensorParallelGroup
    # Raises when a rank this one watches has died (rank 0: its workers; a worker: rank 0); called
    # while waiting outside the collectives (group.rendezvous).
    check_peers: Callable[[], None] = field(default=lambda: None)

    @property
    def rank(self) -> int:
        return self.layout.rank

    @property
    def world_size(self) -> int:
        return self.layout.world_size


__all__ = ["TensorParallel", "TensorParallelGroup", "TensorParallelLayout"]
