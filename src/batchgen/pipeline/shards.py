"""Static shards: `batchgen run job.yaml --shard I/N` runs the units k with k mod N == I.

For clusters without Ray (Slurm arrays, Kubernetes Indexed Jobs): N processes, anywhere, on one
output folder (a shared filesystem or an object store). Each shard holds the folder's lock shared (no
plain run can start beside them) and its own shard's lock exclusively (the same shard twice is
refused), writes its parts and `_workers/shard-I-of-N.json`, then tries to finalize: the shard that
finds every unit committed writes `_SUCCESS` (create-if-absent, see finalize.py). The unit list is the
job's deterministic plan, pinned by the input fingerprint in `_batchgen.json`; `_batchgen.shards.json`
pins N. A shard whose config hash, input or N differs from the folder's refuses to start (exit 2).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from dataclasses import dataclass, field

from batchgen.pipeline.config import JobConfig
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.job_engine import engine_report, start_engine
from batchgen.pipeline.job_plan import JobPlan, plan_job
from batchgen.pipeline.output import (
    Finalized,
    OutputRun,
    ShardSpec,
    describe_redo,
    finalize_folder,
    open_run,
    raise_if_locked,
    raise_if_refused,
)
from batchgen.pipeline.provenance import plan_provenance, with_provenance
from batchgen.pipeline.run_record import EngineReport, Percentiles
from batchgen.pipeline.summary import Totals, read_summary_table, speculative_summary, structured_summary
from batchgen.pipeline.unit_loop import UnitSource, run_units

log = logging.getLogger("batchgen.pipeline")

_SHARD_RE = re.compile(r"(\d+)/(\d+)")


def parse_shard(text: str, num_shards: int | None = None, env: dict[str, str] | None = None) -> ShardSpec:
    """`I/N`, or `auto`: Slurm's array variables, or Kubernetes' JOB_COMPLETION_INDEX with --num-shards.

    `auto` is opt-in because a run inside an unrelated array job must not shard by surprise.
    """
    env = os.environ if env is None else env
    match = _SHARD_RE.fullmatch(text.strip())
    if match:
        if num_shards is not None:
            raise JobError("--num-shards goes with --shard auto; --shard I/N names the count already")
        return _checked(int(match.group(1)), int(match.group(2)), "--shard")
    if text.strip() != "auto":
        raise JobError(f"--shard {text!r}: expected I/N (e.g. 0/4) or auto")
    if "SLURM_ARRAY_TASK_ID" in env:
        # Arrays may start anywhere (--array=1-8): the shard is the task's position in the array.
        try:
            task, first = int(env["SLURM_ARRAY_TASK_ID"]), int(env.get("SLURM_ARRAY_TASK_MIN", "0"))
            count = int(env["SLURM_ARRAY_TASK_COUNT"]) if num_shards is None else num_shards
        except KeyError:
            raise JobError("--shard auto: SLURM_ARRAY_TASK_ID is set but SLURM_ARRAY_TASK_COUNT is not; "
                           "pass --num-shards N") from None
        except ValueError as exc:
            raise JobError(f"--shard auto: unreadable Slurm array variable ({exc})") from None
        return _checked(task - first, count, "SLURM_ARRAY_TASK_ID")
    if "JOB_COMPLETION_INDEX" in env:
        if num_shards is None:
            raise JobError("--shard auto on Kubernetes (JOB_COMPLETION_INDEX) needs --num-shards N "
                           "(the Job's completions)")
        try:
            index = int(env["JOB_COMPLETION_INDEX"])
        except ValueError as exc:
            raise JobError(f"--shard auto: unreadable JOB_COMPLETION_INDEX ({exc})") from None
        return _checked(index, num_shards, "JOB_COMPLETION_INDEX")
    raise JobError("--shard auto: neither SLURM_ARRAY_TASK_ID (a Slurm array) nor JOB_COMPLETION_INDEX "
                   "(a Kubernetes Indexed Job) is set; pass --shard I/N")


def _checked(index: int, count: int, source: str) -> ShardSpec:
    if count < 1 or not 0 <= index < count:
        raise JobError(f"--shard: shard {index} of {count} (from {source}) is not one of 0..{count - 1}")
    return ShardSpec(index, count, source)


@dataclass
class ShardResult:
    shard: ShardSpec
    summary: dict  # this shard's _workers/ summary
    finalized: Finalized
    num_units_run: int
    num_units_skipped: int
    redone: dict[str, str] = field(default_factory=dict)


def run_shard(job: JobConfig, shard: ShardSpec, *, engine=None, limit: int | None = None,
              progress: bool = True) -> ShardResult:
    """Run this shard's units (resuming like a local run), write its summary, try to finalize."""
    if job.cluster.backend != "local":
        raise JobError("--shard runs on this machine: it does not combine with cluster.backend: ray "
                       "(Ray places the units itself)")
    plan = plan_job(job, limit)
    raise_if_refused(plan.state)
    started = time.time()
    if any(shard.owns(unit) for unit in plan.pending_units):
        raise_if_locked(plan.output.storage, shared=True)  # an exclusive run there: refused before loading
        engine = start_engine(job, engine)  # before the folder is touched: a failed start leaves it as it was
    with open_run(plan.output.storage, plan.identity, shard=shard) as run:
        plan.state = run.state
        mine = run.units
        if run.is_complete:
            log.info("%s is complete (_SUCCESS present); nothing to do", job.output.path)
            return ShardResult(shard, {}, Finalized(run.read_success(), False, []), 0, len(mine))
        pending, skipped, redo = run.pending_units, run.skipped_units, run.redo
        if redo:
            log.warning("%s", describe_redo(redo))
        log.info("shard %d/%d (from %s): %d of the job's %d units, %d done, %d to run", shard.index,
                 shard.count, shard.source, len(mine), len(plan.units), len(skipped), len(pending))

        totals, seconds, reports, spec, structured = Totals(), 0.0, EngineReport(), None, None
        provenance = None
        if pending:
            engine = start_engine(job, engine)
            spec_before, structured_before = engine.stats.get("speculative"), engine.stats.get("structured")
            provenance = plan_provenance(plan, engine)
            source = UnitSource(job, with_provenance(plan.inputs.output_schema(job), provenance), plan.repeats)
            ran = run_units(source, plan.input_storage, run.storage, pending, engine, run.commit_context(),
                            progress=progress)
            totals, seconds, reports = ran.totals, ran.generation_seconds, engine_report(engine, job)
            spec = speculative_summary(spec_before, engine.stats.get("speculative"))
            structured = structured_summary(structured_before, engine.stats.get("structured"))
        summary = _shard_summary(plan, run, totals, seconds, reports, started)
        # This run's drafts (None: off, or nothing to run) and constrained requests (None: none).
        summary["speculative"] = None if spec is None else spec.to_dict()
        summary["structured"] = None if structured is None else structured.to_dict()
        summary["provenance"] = provenance
        run.write_worker_summary(summary)
        finalized = finalize_folder(run.storage)
    if finalized.created:
        log.info("shard %d/%d found every unit committed and wrote _SUCCESS", shard.index, shard.count)
    elif finalized.missing:
        log.info("shard %d/%d done; %d unit(s) of other shards not committed yet (%s); the shard that "
                 "commits the last one writes _SUCCESS", shard.index, shard.count, len(finalized.missing),
                 ", ".join(finalized.missing[:10]) + (" ..." if len(finalized.missing) > 10 else ""))
    return ShardResult(shard, summary, finalized, len(pending), len(skipped), redo)


def _shard_summary(plan: JobPlan, run: OutputRun, totals: Totals, seconds: float, reports: EngineReport,
                   started: float) -> dict:
    """This shard's figures: its units (all of them, also those an earlier run wrote), what this run did."""
    whole = Totals(num_requests=totals.num_requests, num_rows=totals.num_rows, num_errors=totals.num_errors,
                   prompt_tokens=totals.prompt_tokens, cached_tokens=totals.cached_tokens,
                   completion_tokens=totals.completion_tokens)
    storage, skipped = run.storage, run.skipped_units
    for unit in skipped:
        with storage.fs.open(storage.join(unit.output_name), "rb") as f:
            whole.add_table(read_summary_table(f))
    return {
        "job": plan.job.name, "config_hash": plan.config_hash, "shard": run.shard.to_dict(),
        "host": socket.gethostname(), "pid": os.getpid(), "started": started, "finished": time.time(),
        "num_units": len(run.units), "units_run": [u.output_name for u in run.pending_units],
        "num_units_skipped": len(skipped), "units_redone": sorted(run.redo), "resumed": bool(skipped),
        "num_requests": whole.num_requests, "num_rows": whole.num_rows, "num_errors": whole.num_errors,
        "prompt_tokens": whole.prompt_tokens, "cached_tokens": whole.cached_tokens,
        # Speed: this run's generation only.
        "completion_tokens": whole.completion_tokens,
        "generated_completion_tokens": totals.completion_tokens, "generation_seconds": seconds,
        "completion_tokens_per_s": totals.completion_tokens / seconds if seconds > 0 else 0.0,
        "ttft_s": Percentiles.of(totals.ttft_s).to_dict(), "tpot_s": Percentiles.of(totals.tpot_s).to_dict(),
        "engine": reports.to_dict(),  # engine_report(): model, kernels, KV cache, weights
        "generation_config": plan.job.generation_config_record,
    }
