"""Ray on a two-node cluster (ray.cluster_utils.Cluster on 127.0.0.1): a node removed mid-job loses no row.

The head has no CPU for actors, each node one, and each replica asks for one: one replica per node, so
removing a node kills exactly one replica. Its replacement finds no free CPU and never becomes ready;
the surviving replica finishes the job and the driver stops the pending one.
"""

from __future__ import annotations

import threading
import time

import pytest
import ray
from ray.cluster_utils import Cluster

from batchgen.pipeline.config import load_job
from batchgen.pipeline.ray_driver import run_on_ray
from tests.pipeline.conftest import read_output
from tests.pipeline.ray_helpers import num_committed
from tests.pipeline.scale_helpers import assert_each_row_once, row_key, run_locally, write_job
from tests.pipeline.slow_replica import SlowReplica

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def cluster():
    # Every node is a raylet on this machine, all on the loopback address (see tests/conftest.py's
    # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER; checked below). Fast node-death detection:
    # the default health check takes ~15 s to declare a node dead.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_memory_monitor_refresh_ms", "0")  # as in test_ray.py: not killed for others' memory
        loopback = "127.0.0.1"
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "include_dashboard": False, "node_ip_address": loopback,
            "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 2}})
        nodes = [cluster.add_node(num_cpus=1, node_ip_address=loopback) for _ in range(2)]
        ray.init(address=cluster.address, _node_ip_address=loopback, log_to_driver=False)
        assert {node["NodeManagerAddress"] for node in ray.nodes()} == {loopback}
        cluster.wait_for_nodes()
        yield cluster, nodes
        ray.shutdown()
        cluster.shutdown()


def test_a_node_removed_mid_job_loses_no_row(tmp_path, cluster, tiny_model):
    ray_cluster, nodes = cluster
    local_rows, _ = run_locally(tmp_path / "local", tiny_model)

    job = load_job(write_job(tmp_path, tiny_model, cluster={"backend": "ray", "replicas": 2, "cpus_per_replica": 1}))
    out = tmp_path / "out" / "scaled"
    removed = threading.Event()

    def remove_a_node() -> None:
        deadline = time.monotonic() + 240
        while num_committed(out) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        # A node whose one CPU a replica holds (its actor asked for cpus_per_replica: 1), so the node
        # taken away surely had units in flight.
        free = ray._private.state.available_resources_per_node()
        busy = [node for node in nodes if free.get(node.node_id, {}).get("CPU", 0) == 0]
        ray_cluster.remove_node(busy[-1], allow_graceful=False)
        removed.set()

    remover = threading.Thread(target=remove_a_node, daemon=True)
    remover.start()
    result = run_on_ray(job, progress=False, replica_class=SlowReplica)
    remover.join()
    assert removed.is_set()
    assert_each_row_once(out)
    assert row_key(read_output(out)) == local_rows
    workers = result.record.workers
    assert workers.replica_failures == 1
    assert 1 <= len(workers.units_retried) <= 2
