"""Is `output.path` reachable from every Ray node? Checked before any replica starts.

Replicas write their parts to `output.path` themselves, so a local path is only right when every node
sees the same folder. What is checked: the driver writes a probe file (a random token) into the output
folder, then one small task pinned to each alive node (NodeAffinity, not soft) reads it back at the
same path; every node must read the same token. A path on a filesystem that every node mounts (NFS,
Lustre, a shared disk) passes, and so does a single-machine cluster; a node-local disk on a cluster of
several machines fails, naming the nodes that cannot see it. Object stores (s3://, gs://, ...) are not
probed: every node reaches them by URL.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable

from batchgen.pipeline.errors import JobError
from batchgen.pipeline.storage import Storage

PROBE_PREFIX = "_batchgen.probe-"


def _read_probe(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def probe_nodes(ray, path: str) -> dict[str, str | None]:
    """{node id (host): the probe's content as that node reads it, None when it cannot}."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    read = ray.remote(num_cpus=0, max_retries=0)(_read_probe)
    refs = {}
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        label = f"{node['NodeID'][:12]} ({node.get('NodeManagerHostname') or node.get('NodeManagerAddress')})"
        strategy = NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
        refs[label] = read.options(scheduling_strategy=strategy).remote(path)
    return {label: ray.get(ref, timeout=120) for label, ref in refs.items()}


def check_output_shared(ray, storage: Storage,
                        probe: Callable[[object, str], dict[str, str | None]] = probe_nodes) -> None:
    """JobError (exit 2) when a local `output.path` is not the same folder on every node."""
    if not storage.is_local:
        return
    os.makedirs(storage.root, exist_ok=True)
    name = f"{PROBE_PREFIX}{uuid.uuid4().hex[:12]}"
    token = uuid.uuid4().hex
    path = storage.join(name)
    with open(path, "w") as f:
        f.write(token)
    try:
        seen = probe(ray, path)
    finally:
        os.remove(path)
    blind = sorted(label for label, content in seen.items() if content != token)
    if blind:
        raise JobError(f"output.path: {storage.url} is a local path, and Ray node(s) {', '.join(blind)} do "
                       "not see the folder the driver sees (a probe file written there was not readable on "
                       "them): replicas write their parts themselves, so output.path must be on a filesystem "
                       "every node shares, or an object store (s3://, gs://)")
