"""Multi-stage jobs: a job file with a `stages:` list (generate -> score or judge -> select), each stage a
job of its own in `<output.path>/<stage name>/` that resumes on its own.

- read:  `load_any_job(path, overrides, limit)` -> a JobConfig (no `stages:`, as before) or a StagedJob
         (spec.py: the graph checked, each stage's settings validated, its identity chained)
- run:   `run_staged_job(staged)` (run.py; select stages in select_run.py, their rules in select_rules.py)
- show:  `format_stage_plan`, `format_stage_results` (text.py)
"""

from __future__ import annotations

import os
from pathlib import Path

from batchgen.pipeline.config import JobConfig, read_job_file, validate_job
from batchgen.pipeline.stages.spec import Stage, StagedJob, is_staged, read_staged_job


def load_any_job(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = (),
                 limit: int | None = None) -> JobConfig | StagedJob:
    """A job file as a single job (load_job's result) or, with `stages:`, as a checked stage graph."""
    job_path = Path(path)
    raw = read_job_file(job_path, overrides)
    if is_staged(raw):
        return read_staged_job(raw, job_path.resolve().parent, str(job_path), limit)
    return validate_job(raw, job_path.resolve().parent, source=str(job_path))


__all__ = ["Stage", "StagedJob", "is_staged", "load_any_job", "read_staged_job"]
