"""EngineReplica: one engine in a Ray actor, loaded once, running unit descriptors into their parts.

The driver (ray_driver.py) sends (unit, repeats) descriptors, never rows: the actor reads its unit's
rows through fsspec itself, runs them with the same ordering as a local run, writes the part and its
commit record atomically to `output.path` (shared storage) and returns the unit's figures. Running a
unit twice (its first actor died after the commit) writes the same part again, which is harmless.
This module does not import Ray: the driver wraps the class with `ray.remote`, so the class name is
what `ray list actors` and the dashboard show.
"""

from __future__ import annotations

import os
import socket

import pyarrow as pa

from batchgen.pipeline.config import JobConfig
from batchgen.pipeline.id_scan import Position
from batchgen.pipeline.job_engine import check_engine_can_run, engine_for, engine_report
from batchgen.pipeline.job_plan import check_model
from batchgen.pipeline.output import CommitContext, WorkUnit
from batchgen.pipeline.provenance import engine_provenance, with_provenance
from batchgen.pipeline.storage import Storage
from batchgen.pipeline.summary import speculative_summary, structured_summary
from batchgen.pipeline.unit_loop import UnitSource, run_units


class EngineReplica:
    """One engine replica: the job's engine, built once in the actor's process."""

    def __init__(self, job: JobConfig, output_schema: pa.Schema, commit: CommitContext):
        self.job = job
        self.commit = commit  # the driver's run: its config hash and run id (the driver holds the lock)
        self.engine = engine_for(job, None)
        check_engine_can_run(job, self.engine)
        # How this replica's rows are made (the model files where it runs): in each part's metadata.
        self.provenance = engine_provenance(job, check_model(job.model.path, job.model.revision), self.engine)
        self.output_schema = with_provenance(output_schema, self.provenance)
        self.input_storage = Storage(job.input.path, job.input.storage_options)
        self.output_storage = Storage(job.output.path, job.output.storage_options)

    def ready(self) -> dict:
        """Where this replica runs and what its engine loaded (answered once the engine is loaded)."""
        return {"host": socket.gethostname(), "pid": os.getpid(), "engine": engine_report(self.engine, self.job),
                "provenance": self.provenance}

    def run_unit(self, unit: WorkUnit, repeats: dict[Position, int]) -> dict:
        """Generate one unit and commit its part; its figures (a Totals) and this process's id."""
        source = UnitSource(self.job, self.output_schema, repeats)
        spec_before, structured_before = self.engine.stats.get("speculative"), self.engine.stats.get("structured")
        ran = run_units(source, self.input_storage, self.output_storage, [unit], self.engine, self.commit,
                        progress=False)
        return {"unit": unit.index, "totals": ran.totals, "generation_seconds": ran.generation_seconds,
                "pid": os.getpid(), "num_rows_reused": ran.num_rows_reused,
                "speculative": speculative_summary(spec_before, self.engine.stats.get("speculative")),
                "structured": structured_summary(structured_before, self.engine.stats.get("structured"))}
