"""One run's hold on its output folder: what the local run, a static shard and the Ray driver all go through.

    with open_run(storage, identity, overwrite=...) as run:          # a plain run, the Ray driver: exclusive
    with open_run(storage, identity, shard=ShardSpec(i, n)) as run:   # a static shard: folder shared, shard exclusive
        run.is_complete, run.read_success()
        run.pending_units, run.skipped_units, run.redo    # read again under the lock
        run.commit_context()                              # the writers commit each unit's part with its record
        run.missing_units()                               # verify: every planned unit committed?
        run.finish(record)                                # _SUCCESS last (OpenAI .jsonl files first where asked)

Shards do not finish: each writes its summary (`write_worker_summary`), then `finalize_folder` (finalize.py)
lets the one that finds every unit committed write `_SUCCESS`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

from batchgen.pipeline.errors import JobError
from batchgen.pipeline.output.checkpoints import remove_checkpoints
from batchgen.pipeline.output.commits import CommitContext, record_name
from batchgen.pipeline.output.create_once import create_text_once
from batchgen.pipeline.output.fingerprint import FileFingerprint
from batchgen.pipeline.output.folder import (
    MANIFEST_NAME,
    SHARDS_MANIFEST_NAME,
    SUCCESS_NAME,
    WORKERS_DIR,
    FolderState,
    OutputFolder,
    grow_parts,
    manifest_text,
    raise_if_refused,
)
from batchgen.pipeline.output.lock import lock_folder, lock_name
from batchgen.pipeline.output.lock_holder import FolderLock
from batchgen.pipeline.output.units import WorkUnit
from batchgen.pipeline.run_record import RunRecord
from batchgen.pipeline.storage import Storage, is_temp_name


@dataclass(frozen=True)
class RunIdentity:
    """What a folder records of the job whose output it holds, and the job's plan of units."""

    job_name: str
    config_hash: str
    fingerprint: list[FileFingerprint]
    units: list[WorkUnit]

    @property
    def unit_names(self) -> list[str]:
        return [u.output_name for u in self.units]


@dataclass(frozen=True)
class ShardSpec:
    """Static shard `index` of `count`: it owns the units k with k mod count == index."""

    index: int
    count: int
    source: str = "--shard"  # where the index came from: "--shard", "SLURM_ARRAY_TASK_ID", "JOB_COMPLETION_INDEX"

    @property
    def name(self) -> str:
        return f"{self.index:05d}-of-{self.count:05d}"

    def owns(self, unit: WorkUnit) -> bool:
        return unit.index % self.count == self.index

    def to_dict(self) -> dict:
        return {"index": self.index, "count": self.count, "source": self.source}


class OutputRun:
    """An output folder held by this run (see the module docstring); made by `open_run`."""

    def __init__(self, folder: OutputFolder, identity: RunIdentity, state: FolderState, locks: list[FolderLock],
                 shard: ShardSpec | None):
        self.folder = folder
        self.identity = identity
        self.state = state
        self.locks = locks
        self.shard = shard

    @property
    def storage(self) -> Storage:
        return self.folder.storage

    @property
    def run_id(self) -> str:
        return self.locks[0].holder.run_id

    def check(self) -> None:
        """Raise LockLost when this run may no longer write here (called before every commit)."""
        for lock in self.locks:
            lock.check()

    @property
    def is_complete(self) -> bool:
        return self.state.is_complete(self.identity.unit_names)

    @property
    def units(self) -> list[WorkUnit]:
        """This run's units: the job's, or a shard's own."""
        return [u for u in self.identity.units if self.shard is None or self.shard.owns(u)]

    @property
    def pending_units(self) -> list[WorkUnit]:
        return [u for u in self.units if u.output_name not in self.state.done_names]

    @property
    def skipped_units(self) -> list[WorkUnit]:
        """Units an earlier run committed (their parts verified)."""
        return [u for u in self.units if u.output_name in self.state.done_names]

    @property
    def redo(self) -> dict[str, str]:
        """This run's unit files that were present but not trusted -> why (they run again)."""
        own = {u.output_name for u in self.units}
        return {name: why for name, why in self.state.redo.items() if name in own}

    def read_success(self) -> RunRecord:
        return self.folder.read_success()

    def commit_context(self, *, is_remote: bool = False) -> CommitContext:
        """For the writers of this run's parts. `is_remote`: writers in other processes (Ray replicas), which
        cannot check this process's lock; the driver verifies every commit before `finish`."""
        return CommitContext(self.identity.config_hash, self.run_id, (lambda: None) if is_remote else self.check)

    def missing_units(self) -> list[str]:
        """The job's units whose part is not committed and verified, read from the folder now."""
        identity = self.identity
        done = self.folder.state(identity.config_hash, identity.fingerprint, identity.units).done_names
        return [name for name in identity.unit_names if name not in done]

    def finish(self, record: RunRecord, *, write_batch_outputs: bool = False) -> str:
        """Write `_SUCCESS` (after output.jsonl / errors.jsonl from every committed part, when asked) while
        the run still holds its folder; its path."""
        if write_batch_outputs:
            from batchgen.pipeline.batch_output import write_batch_outputs as write_jsonl

            self.check()
            write_jsonl(self.storage, self.identity.unit_names)
        self.check()
        remove_checkpoints(self.storage)  # every unit is committed: what they saved is in the parts
        return self.folder.write_success(record)

    def write_worker_summary(self, summary: dict) -> None:
        """A static shard's `_workers/shard-I-of-N.json` (merged into `_SUCCESS` by finalize_folder)."""
        if self.shard is None:
            raise ValueError("only a static shard writes a worker summary")
        self.check()
        self.storage.write_text_atomic(f"{WORKERS_DIR}/shard-{self.shard.name}.json",
                                       json.dumps(summary, indent=1) + "\n")


@contextmanager
def open_run(storage: Storage, identity: RunIdentity, *, overwrite: bool = False,
             shard: ShardSpec | None = None) -> Iterator[OutputRun]:
    """Take the folder's lock (LockHeld, a JobError, names the holder), read and prepare it under the lock
    (JobError when it holds another job's output, unless `overwrite`), and hold it until the block ends."""
    folder = OutputFolder(storage)
    with ExitStack() as stack:
        if shard is None:
            locks = [stack.enter_context(lock_folder(storage))]
            # Read the folder again under the lock: another run may have finished units since the plan looked.
            state = folder.prepare(identity.job_name, identity.config_hash, identity.fingerprint, identity.units,
                                   overwrite)
        else:
            if overwrite:  # the command line refuses --overwrite with --shard before this, saying why
                raise ValueError("a static shard never clears the folder: other shards' work is in it")
            locks = [stack.enter_context(lock_folder(storage, shared=True)),
                     stack.enter_context(lock_folder(storage, name=lock_name(shard.name)))]
            state = _prepare_shard(folder, identity, shard)
        yield OutputRun(folder, identity, state, locks, shard)


def _prepare_shard(folder: OutputFolder, identity: RunIdentity, shard: ShardSpec) -> FolderState:
    """The folder under the shared lock: the manifests created once (and checked), this shard's own
    leftovers cleared. Other shards are live beside us, so only what belongs to our units is touched."""
    storage = folder.storage
    manifest = manifest_text(identity.job_name, identity.config_hash, identity.fingerprint, identity.units)
    create_text_once(storage, MANIFEST_NAME, manifest)
    shards_text = json.dumps({"num_shards": shard.count, "config_hash": identity.config_hash}, indent=1) + "\n"
    create_text_once(storage, SHARDS_MANIFEST_NAME, shards_text)
    recorded = json.loads(storage.read_text(SHARDS_MANIFEST_NAME))
    if recorded.get("num_shards") != shard.count:
        raise JobError(f"--shard {shard.index}/{shard.count}: {storage.url} was started with "
                       f"{recorded.get('num_shards')} shards, this run says {shard.count} "
                       f"(from {shard.source}); run every shard with the same N")
    # Read again now that the manifest is ours for sure: a shard with another config that raced us to
    # an empty folder lost the create above and is refused here, naming both hashes.
    state = folder.state(identity.config_hash, identity.fingerprint, identity.units)
    raise_if_refused(state)
    own = {u.output_name for u in identity.units if shard.owns(u)}
    for name in storage.list_names():  # temp files of our units are a dead run's of this very shard
        if is_temp_name(name) and any(name.startswith(f".{part}.") for part in own):
            storage.remove(name)
    if state.has_success and not state.is_complete(identity.unit_names):
        storage.remove(SUCCESS_NAME)  # it stood beside a missing or damaged part: this job is not complete
    for name in state.redo:
        if name in own and storage.fs.exists(storage.join(record_name(name))):
            storage.remove(record_name(name))
    if not state.is_manifest_current:  # this job over more rows (--limit): every shard writes the same text
        storage.write_text_atomic(MANIFEST_NAME, manifest)
    redo = {**state.redo, **grow_parts(storage, {n: u for n, u in state.grown.items() if n in own},
                                       identity.config_hash)}
    return FolderState(state.done_names, state.has_success, None, redo, has_manifest=True)
