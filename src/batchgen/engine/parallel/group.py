"""The collectives of one tensor-parallel group: gloo between CPU processes, NCCL between GPUs.

The group is a process group of its own, built on a TCPStore that rank 0 (the engine's process) hosts
on the loopback address: nothing is registered with torch.distributed's default group, so an engine
with workers lives beside any other use of torch.distributed in the caller's process, and a second
engine gets a group of its own.

Every collective has a timeout (COLLECTIVE_TIMEOUT): a rank that stops answering ends the others'
wait with an error instead of a hang. A rank that dies closes its connections, which ends the
others' current collective at once (gloo: "Connection closed by peer"); the executor then names the
rank (mp_executor.py). The only unbounded waits are outside the collectives: a worker waiting for
the next command (it checks that rank 0 is alive every second) and the load barrier below, which
checks every rank's process while it waits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

# A collective waits this long for the other ranks. Ranks run the same layer at the same time, so a
# healthy wait is one layer's imbalance; loading, which takes minutes, waits in `rendezvous` instead.
COLLECTIVE_TIMEOUT = timedelta(seconds=120)
STORE_TIMEOUT = timedelta(seconds=120)
_RENDEZVOUS_POLL_S = 0.05


class TensorParallelGroup:
    """Rank `rank` of `world_size` processes running one model; `device` is this rank's."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, device: torch.device,
                 timeout: timedelta = COLLECTIVE_TIMEOUT, check_peers: Callable[[], None] | None = None,
                 in_background: bool = False):
        """Join the group: first a rendezvous of every rank on the store (as long as the slowest takes to
        start, `check_peers` raising when a rank this one watches died), then the process group itself,
        which then connects within its timeout. `in_background`: on a thread, so rank 0 loads its shard
        meanwhile; the first collective waits for it."""
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.is_nccl = device.type == "cuda"
        self._timeout = timeout
        self._check_peers = check_peers or (lambda: None)
        self._group: dist.ProcessGroup | None = None
        self._error: BaseException | None = None
        self._connecting = threading.Thread(target=self._connect, name="batchgen-tp-connect", daemon=True)
        if in_background:
            self._connecting.start()
        else:
            self._connect()
            self._raise_if_failed()

    def _connect(self) -> None:
        try:
            self.rendezvous("join", self._check_peers)
            if self.is_nccl:
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = self._timeout
                self._group = dist.ProcessGroupNCCL(self.store, self.rank, self.world_size, options)
            else:
                self._group = dist.ProcessGroupGloo(self.store, self.rank, self.world_size, self._timeout)
        except Exception as exc:  # raised again by the first collective (and by rank 0's load barrier)
            self._error = exc

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"rank {self.rank} could not join the tensor-parallel group: {self._error}") \
                from self._error

    @property
    def _pg(self) -> dist.ProcessGroup:
        if self._group is None:
            self._connecting.join()
            self._raise_if_failed()
        return self._group

    @classmethod
    def connect(cls, port: int, rank: int, world_size: int, device: torch.device,
                check_peers: Callable[[], None] | None = None) -> TensorParallelGroup:
        """A worker's side: rank 0's store on the loopback port, then the group (waits for every rank)."""
        store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=STORE_TIMEOUT)
        return cls(store, rank, world_size, device, check_peers=check_peers)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns it."""
        self._pg.allreduce([x]).wait()
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` into every rank's `x` (same shape and dtype), in place."""
        self._pg.broadcast([x], dist.BroadcastOptions()).wait()
        return x

    def gather_columns(self, local: torch.Tensor) -> torch.Tensor | None:
        """Every rank's (N, C) `local`, side by side as (N, world_size x C) on rank 0 (in rank order).

        gloo: a gather to rank 0, the others get None. NCCL: an all-gather (every rank gets the
        whole; a gather is not a collective NCCL captures in a CUDA graph), reordered to columns.
        """
        local = local.contiguous()
        if self.is_nccl:
            rows = torch.empty((self.world_size * local.shape[0], local.shape[1]), dtype=local.dtype,
                               device=local.device)  # (world x N, C): rank r's rows at r x N
            self._pg._allgather_base(rows, local).wait()
            return rows.view(self.world_size, *local.shape).permute(1, 0, 2).reshape(local.shape[0], -1)
        options = dist.GatherOptions()
        options.rootRank = 0
        parts = [torch.empty_like(local) for _ in range(self.world_size)] if self.is_first else []
        self._pg.gather([parts] if self.is_first else [], [local], options).wait()
        return torch.cat(parts, dim=1) if self.is_first else None

    def rendezvous(self, name: str, check_peers: Callable[[], None]) -> None:
        """Wait until every rank has reached `name`, however long that takes (loading a shard may take
        minutes), calling `check_peers` between looks: it raises when a rank this one watches died."""
        key = f"rendezvous/{name}"
        self.store.add(key, 1)
        while self.store.add(key, 0) < self.world_size:
            check_peers()
            if self._error is not None:  # this rank's own join failed (on its thread)
                self._raise_if_failed()
            time.sleep(_RENDEZVOUS_POLL_S)
