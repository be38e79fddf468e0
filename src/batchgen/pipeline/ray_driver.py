"""`cluster.backend: ray`: this process is the driver; engine replicas (Ray actors) run the units.

The driver plans the units, checks the output folder and holds its lock, starts `replicas` EngineReplica
actors, and keeps at most two unit descriptors in flight per replica (one running, one queued, so a
replica never waits on a round trip; a replacement gets units only once its engine is loaded, since it
may wait for resources that never come back). Rows never pass through the driver. When a replica dies (its
process killed, its node lost, OOM), the driver puts its in-flight units back at the front of the queue
and starts a replacement, at most `max(MIN_RESTARTS, replicas)` times in all; past that the job fails
(exit 1) naming the units not committed, and a rerun resumes. A Python error inside a unit is a bug or
a bad row the pipeline did not catch: it fails the job at once, it is not retried. The driver, not a
replica, writes `_SUCCESS`, after reading the folder back: every unit must be committed.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from batchgen.pipeline.config import ClusterSection, JobConfig
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.job_finish import RunResult, finish_job
from batchgen.pipeline.job_plan import JobPlan, plan_job
from batchgen.pipeline.output import (
    SUCCESS_NAME,
    CommitContext,
    WorkUnit,
    check_output_shared,
    describe_redo,
    open_run,
    probe_nodes,
    raise_if_refused,
)
from batchgen.pipeline.replica import EngineReplica
from batchgen.pipeline.run_record import (
    EngineReport,
    ReplicaPlacement,
    SpeculativeFigures,
    StructuredFigures,
    Workers,
)
from batchgen.pipeline.summary import Totals, merge_speculative, merge_structured
from batchgen.pipeline.unit_loop import repeats_of

log = logging.getLogger("batchgen.pipeline")

UNITS_IN_FLIGHT = 2  # per replica: the one it runs and the next, already on its queue
MIN_RESTARTS = 2  # replacement replicas allowed per job: max(MIN_RESTARTS, replicas)
WAIT_SECONDS = 1.0  # how often the driver wakes without a result (progress bar, replicas alive)


class ReplicasFailed(RuntimeError):
    """Every replica died and the restart bound is spent (exit 1); the message names the missing units."""


def import_ray():
    try:
        import ray
    except ImportError:
        raise JobError("cluster.backend: ray needs Ray: pip install 'batchgen[ray]'") from None
    return ray


def connect(ray, cluster: ClusterSection) -> bool:
    """Join or start the cluster unless this process is connected already; True when this call connected.

    address null: Ray's own rule (RAY_ADDRESS if set, else a new local cluster); auto or ray://...: join.
    """
    if ray.is_initialized():
        return False
    ray.init(address=cluster.address, log_to_driver=False)
    return True


def replica_count(ray, cluster: ClusterSection, tensor_parallel_size: int = 1) -> tuple[int, float]:
    """(replicas, GPUs per replica): auto is one per GPU in the cluster (one per tensor_parallel_size
    GPUs), one on a CPU-only cluster."""
    num_gpus = int(ray.cluster_resources().get("GPU", 0))
    per_replica = cluster.gpus_per_replica
    if tensor_parallel_size > 1 and num_gpus:
        per_replica = tensor_parallel_gpus(ray, cluster, tensor_parallel_size)
    gpus = per_replica if num_gpus else 0.0
    if cluster.replicas == "auto":
        return (max(1, int(num_gpus // per_replica)) if num_gpus and per_replica else 1), gpus
    return cluster.replicas, gpus


def tensor_parallel_gpus(ray, cluster: ClusterSection, tensor_parallel_size: int) -> int:
    """A tensor-parallel replica's GPUs, all on one node: its ranks are the actor's process and the
    worker processes the engine starts beside it (engine/parallel/), one GPU each, so the actor holds
    every GPU of its replica (Ray places an actor's resources on one node: a one-bundle, strictly
    packed placement). JobError when gpus_per_replica says otherwise or no node has that many GPUs."""
    size = tensor_parallel_size
    if "gpus_per_replica" in cluster.model_fields_set and cluster.gpus_per_replica != size:
        raise JobError(f"cluster.gpus_per_replica {cluster.gpus_per_replica:g} with engine.tensor_parallel_size "
                       f"{size}: a replica holds one GPU per rank; set gpus_per_replica: {size} or leave it out")
    largest = max((node.get("Resources", {}).get("GPU", 0) for node in ray.nodes() if node.get("Alive")), default=0)
    if largest < size:
        raise JobError(f"engine.tensor_parallel_size {size}: no node of the Ray cluster has {size} GPUs (the "
                       f"most on one node: {largest:g}); a replica's ranks run on one node (its actor and the "
                       f"processes it starts), so tensor parallelism across nodes is not supported")
    return size


@dataclass
class Replica:
    handle: object
    ready_ref: object | None  # the pending ready() call; None once it answered
    is_replacement: bool  # a replacement gets units only once ready: it may wait for resources forever
    in_flight: dict = field(default_factory=dict)  # ObjectRef -> WorkUnit
    where: dict = field(default_factory=dict)  # host, pid once ready

    @property
    def takes_units(self) -> bool:
        return self.ready_ref is None or not self.is_replacement


def run_on_ray(job: JobConfig, *, limit: int | None = None, overwrite: bool = False, progress: bool = True,
               probe: Callable = probe_nodes, replica_class: type = EngineReplica):
    """Run the job on Ray replicas; returns a RunResult like a local run. `probe`: how each node's view of
    a local output folder is read (shared_storage.probe_nodes; tests stand in a node that sees nothing);
    `replica_class`: the actor (EngineReplica's methods; tests: one without an engine)."""
    plan = plan_job(job, limit)
    if not overwrite:
        raise_if_refused(plan.state)
    ray = import_ray()
    connected = connect(ray, job.cluster)
    try:
        check_output_shared(ray, plan.output.storage, probe)  # before any replica loads a model
        with open_run(plan.output.storage, plan.identity, overwrite=overwrite) as run:
            plan.state = run.state
            success_path = run.storage.join(SUCCESS_NAME)
            if run.is_complete:
                log.info("%s is complete (_SUCCESS present); nothing to do", job.output.path)
                return RunResult(run.read_success(), success_path, 0, len(plan.units))
            if run.redo:
                log.warning("%s", describe_redo(run.redo))
            pending, skipped = run.pending_units, run.skipped_units
            driver = _Driver(ray, plan, run.commit_context(is_remote=True), progress, replica_class)
            this_run = driver.run(pending)
            run.check()
            missing = run.missing_units()
            if missing:
                raise RuntimeError(f"replicas reported every unit done, but {len(missing)} unit(s) are not "
                                   f"committed in {job.output.path}: {', '.join(missing[:20])}")
            record = finish_job(job, run, this_run, driver.generation_seconds, workers=driver.workers(),
                                speculative=merge_speculative(driver.speculative),
                                structured=merge_structured(driver.structured), engine=driver.engine_report,
                                provenance=driver.provenance, num_rows_reused=driver.num_rows_reused)
            return RunResult(record, success_path, len(pending), len(skipped), dict(run.redo),
                             driver.num_rows_reused, this_run.num_rows)
    finally:
        if connected:
            ray.shutdown()


class _Driver:
    """The scheduling loop: replicas, the unit queue, failures, the progress bar."""

    def __init__(self, ray, plan: JobPlan, commit: CommitContext, progress: bool,
                 replica_class: type = EngineReplica):
        self.ray = ray
        self.plan = plan
        self.job = plan.job
        tensor_parallel_size = self.job.engine.tensor_parallel_size
        self.num_replicas, self.gpus = replica_count(ray, self.job.cluster, tensor_parallel_size)
        self.restarts_left = max(MIN_RESTARTS, self.num_replicas)
        options = {"num_gpus": self.gpus, "max_restarts": 0, "max_task_retries": 0}
        if self.job.cluster.cpus_per_replica is not None:
            options["num_cpus"] = self.job.cluster.cpus_per_replica
        elif tensor_parallel_size > 1 and not self.gpus:  # CPU ranks: one core each, on the actor's node
            options["num_cpus"] = tensor_parallel_size
        self.actor_class = ray.remote(replica_class).options(**options)
        self.init_args = (self.job, plan.inputs.output_schema(self.job), commit)
        self.replicas: list[Replica] = []
        self.failures = 0
        self.retried: set[str] = set()
        self.engine_report = EngineReport()  # the first replica's (every replica loads the same job)
        self.provenance: dict | None = None  # the first replica's (pipeline/provenance.py)
        self.num_rows_reused = 0  # output rows the replicas took from earlier runs' checkpoints
        self.speculative: list[SpeculativeFigures | None] = []  # each unit's draft and accepted tokens (None: off)
        self.structured: list[StructuredFigures | None] = []  # each unit's constrained requests (None: none)
        self.started: list[dict] = []
        self.generation_seconds = 0.0
        self.first_ready: float | None = None  # monotonic time the first replica was ready
        self.progress = progress

    def workers(self) -> Workers:
        return Workers(backend="ray", num_workers=self.num_replicas, gpus_per_replica=self.gpus,
                       replica_failures=self.failures, units_retried=sorted(self.retried),
                       replicas=[ReplicaPlacement(**where) for where in self.started])

    def _start_replica(self, is_replacement: bool = False) -> None:
        handle = self.actor_class.remote(*self.init_args)
        self.replicas.append(Replica(handle, handle.ready.remote(), is_replacement))

    def run(self, units: list[WorkUnit]) -> Totals:
        queue = deque(units)
        totals = Totals()
        for _ in range(self.num_replicas):
            self._start_replica()
        log.info("ray: %d replica(s) (%s GPU each), %d unit(s) to run", self.num_replicas, self.gpus,
                 len(units))
        bar = tqdm(total=sum(u.num_rows for u in units), desc=self.job.name, unit="req",
                   disable=not self.progress, dynamic_ncols=True)
        start = time.monotonic()
        try:
            while queue or any(r.in_flight for r in self.replicas):
                self._submit(queue)
                waiting = {ref: r for r in self.replicas for ref in
                           ([r.ready_ref] if r.ready_ref is not None else []) + list(r.in_flight)}
                if not waiting:
                    raise self._exhausted(queue)
                done, _ = self.ray.wait(list(waiting), num_returns=1, timeout=WAIT_SECONDS)
                for ref in done:
                    replica = waiting[ref]
                    if replica not in self.replicas:
                        continue  # a result of a replica already declared dead
                    self._collect(ref, replica, queue, totals, bar)
                rate = totals.completion_tokens / max(time.monotonic() - start, 1e-9)
                alive = sum(r.ready_ref is None for r in self.replicas)
                bar.set_postfix_str(f"{rate:,.1f} tok/s, {alive}/{self.num_replicas} replicas", refresh=False)
        except BaseException:
            self._stop_all()
            raise
        finally:
            bar.close()
        # As a local run's: from the first engine able to take a request (a replica ready), not from the
        # replicas' model loading, to the last result.
        self.generation_seconds = time.monotonic() - (self.first_ready or start)
        self._stop_all()
        return totals

    def _submit(self, queue: deque) -> None:
        for replica in self.replicas:
            while replica.takes_units and len(replica.in_flight) < UNITS_IN_FLIGHT and queue:
                unit = queue.popleft()
                ref = replica.handle.run_unit.remote(unit, repeats_of(self.plan.repeats, [unit]))
                replica.in_flight[ref] = unit

    def _collect(self, ref, replica: Replica, queue: deque, totals: Totals, bar) -> None:
        ray = self.ray
        try:
            result = ray.get(ref)
        except _replica_lost(ray) as exc:
            self._replica_died(replica, queue, exc)
            return
        except ray.exceptions.RayTaskError as exc:
            unit = replica.in_flight.get(ref)
            name = unit.output_name if unit is not None else "its engine start"
            raise RuntimeError(f"a replica failed on {name}: {exc}") from None
        if ref is replica.ready_ref:
            replica.ready_ref = None
            self.first_ready = self.first_ready or time.monotonic()
            replica.where = {"host": result["host"], "pid": result["pid"]}
            if not self.started:
                self.engine_report = result["engine"]
                self.provenance = result.get("provenance")
            self.started.append(replica.where)
            return
        unit = replica.in_flight.pop(ref)
        totals.merge(result["totals"])
        self.num_rows_reused += result.get("num_rows_reused", 0)
        self.speculative.append(result.get("speculative"))
        self.structured.append(result.get("structured"))
        bar.update(unit.num_rows)

    def _replica_died(self, replica: Replica, queue: deque, exc: BaseException) -> None:
        lost = sorted(replica.in_flight.values(), key=lambda u: u.index)
        self.failures += 1
        self.retried.update(u.output_name for u in lost)
        queue.extendleft(reversed(lost))  # back at the front, in unit order
        self.replicas.remove(replica)
        try:
            self.ray.kill(replica.handle)
        except Exception:  # already gone
            pass
        where = replica.where or "before it was ready"
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if self.restarts_left > 0:
            self.restarts_left -= 1
            log.warning("ray: replica %s died (%s); %d unit(s) re-queued (%s); starting a replacement "
                        "(%d more allowed)", where, reason, len(lost),
                        ", ".join(u.output_name for u in lost) or "-", self.restarts_left)
            self._start_replica(is_replacement=True)
        else:
            log.warning("ray: replica %s died (%s); no restarts left", where, reason)

    def _exhausted(self, queue: deque) -> ReplicasFailed:
        names = [u.output_name for u in sorted(queue, key=lambda u: u.index)]
        shown = ", ".join(names[:20]) + (" ..." if len(names) > 20 else "")
        bound = max(MIN_RESTARTS, self.num_replicas)
        return ReplicasFailed(f"every replica died ({self.failures} failures; the bound of {bound} "
                              f"replacements is spent): {len(names)} unit(s) not committed: {shown}. "
                              "Rerun the job: it resumes from the committed units")

    def _stop_all(self) -> None:
        for replica in self.replicas:
            try:
                self.ray.kill(replica.handle)
            except Exception:
                pass
        self.replicas = []


def _replica_lost(ray) -> tuple[type[BaseException], ...]:
    """What a call raises when its replica's process is gone: killed, crashed, its node lost, or ended by
    Ray's memory monitor (OOM). The units it held are run again elsewhere."""
    errors = ray.exceptions
    return (errors.RayActorError, errors.OutOfMemoryError, errors.WorkerCrashedError, errors.NodeDiedError)
