"""The output folder, exactly once: the one API the rest of the pipeline uses (nothing imports the modules below).

- plan:    `plan_units` (input rows -> WorkUnits, each one `part-NNNNN.parquet`)
- look:    `OutputFolder(storage).state(...)` (read only: what is done, whose output it is) for `validate`
- open:    `open_run(storage, RunIdentity, overwrite=, shard=)` -> OutputRun: the lock held, the folder prepared
           (`raise_if_locked` first: a held local folder refused before a run loads its engine)
- commit:  `OutputRun.commit_context()` -> CommitContext.commit_unit (a part visible whole, then its record)
- verify:  `OutputRun.missing_units()`; a part counts only with a matching commit record (commits.py)
- finish:  `OutputRun.finish(record)` (`_SUCCESS`, written last); after shards `finalize_folder(storage)`

Modules: run.py (the run's hold), folder.py (the folder's state and manifest), lock.py / lease.py (one run
at a time: flock locally, a lease on object stores; lock_holder.py: the holder and the errors both raise),
create_once.py, commits.py, fingerprint.py (the input pinned), units.py, finalize.py, shared_storage.py (a
Ray cluster sees one folder), checkpoints.py (finished rows durable every output.checkpoint_seconds).
"""

from batchgen.pipeline.output.checkpoints import (
    CHECKPOINTS_DIR,
    CheckpointWriter,
    RestoredRows,
    load_checkpoints,
    remove_checkpoints,
)
from batchgen.pipeline.output.commits import CommitContext, IdChecksum
from batchgen.pipeline.output.finalize import Finalized, finalize_folder
from batchgen.pipeline.output.fingerprint import FileFingerprint, fingerprint_files
from batchgen.pipeline.output.folder import (
    ERRORS_JSONL,
    MANIFEST_NAME,
    OUTPUT_JSONL,
    REPORT_NAME,
    SUCCESS_NAME,
    FolderState,
    OutputFolder,
    check_output_outside_input,
    describe_redo,
    raise_if_refused,
)
from batchgen.pipeline.output.lock import raise_if_locked
from batchgen.pipeline.output.lock_holder import LockHeld, LockLost
from batchgen.pipeline.output.run import OutputRun, RunIdentity, ShardSpec, open_run
from batchgen.pipeline.output.shared_storage import check_output_shared, probe_nodes
from batchgen.pipeline.output.units import WorkUnit, contiguous_runs, plan_units, unit_file_name

__all__ = [
    "ERRORS_JSONL", "MANIFEST_NAME", "OUTPUT_JSONL", "REPORT_NAME", "SUCCESS_NAME", "CommitContext", "FileFingerprint", "Finalized", "FolderState",
    "IdChecksum", "LockHeld", "LockLost", "OutputFolder", "OutputRun", "RunIdentity", "ShardSpec", "WorkUnit",
    "check_output_outside_input", "check_output_shared", "contiguous_runs", "describe_redo", "finalize_folder",
    "fingerprint_files", "open_run", "plan_units", "probe_nodes", "raise_if_locked", "raise_if_refused",
    "unit_file_name",
    "CHECKPOINTS_DIR", "CheckpointWriter", "RestoredRows", "load_checkpoints", "remove_checkpoints",
]
