"""`cluster.backend: ray` with engine.tensor_parallel_size > 1: a replica's actor holds all its ranks'
GPUs on one node (its ranks are the actor's process and the processes its engine starts), or the job
is refused naming why. The placement arithmetic against a stand-in for Ray's cluster view; a real Ray
run of a tensor-parallel job is in docs/benchmarks/history/gpu-path.md (the suite's Ray tests run on 2
CPUs)."""

from __future__ import annotations

import pytest

from batchgen.pipeline.config import ClusterSection
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.ray_driver import replica_count


class Cluster:
    """ray.cluster_resources() and ray.nodes() of nodes with the given GPU counts."""

    def __init__(self, *gpus_per_node: int):
        self.gpus = gpus_per_node

    def cluster_resources(self) -> dict:
        return {"GPU": float(sum(self.gpus)), "CPU": 64.0}

    def nodes(self) -> list[dict]:
        return [{"Alive": True, "Resources": {"GPU": float(n), "CPU": 32.0}} for n in self.gpus]


def test_each_replica_holds_its_ranks_gpus():
    assert replica_count(Cluster(8, 8), ClusterSection(backend="ray"), 4) == (4, 4)  # 16 GPUs, 4 a replica
    assert replica_count(Cluster(8), ClusterSection(backend="ray", replicas=1), 2) == (1, 2)
    assert replica_count(Cluster(8), ClusterSection(backend="ray", gpus_per_replica=2), 2) == (4, 2)
    assert replica_count(Cluster(), ClusterSection(backend="ray"), 2) == (1, 0.0)  # CPU ranks


def test_a_replica_that_would_not_fit_one_node_is_refused():
    with pytest.raises(JobError, match=r"engine.tensor_parallel_size 4: no node of the Ray cluster has 4 GPUs "
                                       r"\(the most on one node: 2\).*across nodes is not supported"):
        replica_count(Cluster(2, 2), ClusterSection(backend="ray"), 4)
    with pytest.raises(JobError, match=r"cluster.gpus_per_replica 1 with engine.tensor_parallel_size 2: a "
                                       r"replica holds one GPU per rank; set gpus_per_replica: 2"):
        replica_count(Cluster(8), ClusterSection(backend="ray", gpus_per_replica=1), 2)
