"""An EngineReplica that takes a while over each unit, so a test can be sure that units are still in
flight on every replica when it removes a node (a tiny model finishes a 12-unit job in about a second)."""

from __future__ import annotations

import time

from batchgen.pipeline.replica import EngineReplica

SECONDS_PER_UNIT = 0.5


class SlowReplica(EngineReplica):
    def run_unit(self, unit, repeats):
        time.sleep(SECONDS_PER_UNIT)
        return super().run_unit(unit, repeats)
