"""How the suite runs under pytest-xdist (`make test`: `-n 2 --dist loadgroup`, docs/development.md).

- A worker's tests run on one torch thread: two workers on the 2-core machine, each with torch's
  default of one thread per core, would run four threads on two cores. The processes a test starts
  (servers, CLI runs) keep torch's default.
- Tests are sent to workers a module at a time (their module fixtures, one server or one Ray
  cluster, start once), and the modules of one `xdist_group` to one worker, in turn.
"""

from __future__ import annotations

import os

import pytest


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(int(os.environ.get("BATCHGEN_TEST_WORKER_THREADS", "1")))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class ModuleOrGroupScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            grouped = super()._split_scope(nodeid)  # the group's name, or the nodeid when it has none
            return nodeid.split("::", 1)[0] if grouped == nodeid else grouped

    return ModuleOrGroupScheduling(config, log)
