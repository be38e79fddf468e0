"""The Ray driver holds unit descriptors, never rows: its RSS grows less than 50 MB over a 1M-row job.

Runs in a fresh interpreter (its own Ray cluster, 2 CPUs, 127.0.0.1) so the figure is the driver's
alone. The replicas have a null engine (tests/pipeline/null_replica.py), so a million rows take
seconds. Measured: peak RSS (VmHWM, reset just before) over the driver's scheduling loop, after the
plan; and, for the record, over the whole run_on_ray call, plan included.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.subprocess]

NUM_ROWS = 1_000_000
REPO = Path(__file__).resolve().parents[2]

DRIVER = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import ray
    from batchgen.pipeline import ray_driver
    from batchgen.pipeline.config import validate_job
    from tests.pipeline.null_replica import NullReplica

    def status_mb(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024

    def reset_peak():
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return status_mb("VmRSS")

    loop = {}
    run = ray_driver._Driver.run

    def measured_run(self, units):
        before = reset_peak()
        totals = run(self, units)
        loop.update(units=len(units), growth_mb=status_mb("VmHWM") - before)
        return totals

    ray_driver._Driver.run = measured_run
    ray.init(num_cpus=2, include_dashboard=False, address="local", _node_ip_address="127.0.0.1",
             log_to_driver=False)
    tmp = Path(sys.argv[1])
    job = validate_job({"name": "mem", "model": {"path": "smollm2-135m-instruct"},
                        "input": {"path": str(tmp / "in.parquet"), "apply_chat_template": False},
                        "cluster": {"backend": "ray", "replicas": 2},
                        "output": {"path": str(tmp / "out")}}, tmp)
    before = reset_peak()
    result = ray_driver.run_on_ray(job, progress=False, replica_class=NullReplica)
    whole = status_mb("VmHWM") - before
    ray.shutdown()
    print(json.dumps({"num_rows": result.record.num_rows, "loop": loop, "whole_mb": whole}))
""")


def test_the_ray_driver_holds_descriptors_not_rows(tmp_path):
    ids = pa.array(range(NUM_ROWS), pa.int64())
    pq.write_table(pa.table({"id": ids, "prompt": pa.array(["Say something."] * NUM_ROWS)}),
                   tmp_path / "in.parquet")
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_memory_monitor_refresh_ms": "0"}  # workers import tests/
    done = subprocess.run([sys.executable, "-c", DRIVER, str(tmp_path)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["num_rows"] == NUM_ROWS
    assert figures["loop"]["units"] == NUM_ROWS // 10000  # rows_per_unit's default
    assert figures["loop"]["growth_mb"] < 50, figures  # scheduling 100 units of 10,000 rows: ~1 MB measured
    assert figures["whole_mb"] < 50, figures  # plan (footers, the id scan) included: ~20 MB measured
