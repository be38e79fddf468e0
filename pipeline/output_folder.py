"""The output folder is the truth: which units are done, whose job it holds, whether it is complete.

Files: part-NNNNN.parquet (one per finished unit), `_batchgen.json` (the job name and config hash,
written when a run starts, so a later run can tell "resume this" from "a different job"), and
`_SUCCESS` (written last). Names starting with _ or . are skipped by Parquet dataset readers.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from batchgen.pipeline.errors import JobError
from batchgen.pipeline.storage import TEMP_PREFIX, TEMP_SUFFIX, Storage

MANIFEST_NAME = "_batchgen.json"
SUCCESS_NAME = "_SUCCESS"
_PART_RE = re.compile(r"part-\d{5,}\.parquet")


@dataclass(frozen=True)
class FolderState:
    """What the folder holds for this job: finished unit files, _SUCCESS, or someone else's output."""

    done_names: frozenset[str]  # unit files already there (none counted in a refused folder)
    has_success: bool  # _SUCCESS present (written by this very config)
    refusal: str | None  # why this folder holds someone else's output (None: it is ours or empty)

    def is_complete(self, unit_names: list[str]) -> bool:
        """_SUCCESS and every unit's file: the folder is the truth, so a deleted file is work to redo."""
        return self.has_success and all(name in self.done_names for name in unit_names)

    def describe(self, unit_names: list[str]) -> str:
        num_units = len(unit_names)
        num_done = sum(name in self.done_names for name in unit_names)
        if self.refusal:
            return f"refused without --overwrite: {self.refusal}"
        if self.is_complete(unit_names):
            return "complete (_SUCCESS present): a run has nothing to do"
        if num_done:
            return f"resume: {num_done} of {num_units} units done, {num_units - num_done} to run"
        return "new"


class OutputFolder:
    def __init__(self, storage: Storage):
        self.storage = storage

    @property
    def display(self) -> str:
        return self.storage.url

    def state(self, config_hash: str) -> FolderState:
        names = [n for n in self.storage.list_names() if not n.startswith(TEMP_PREFIX)]
        parts = frozenset(n for n in names if _PART_RE.fullmatch(n))
        if not names:
            return FolderState(frozenset(), False, None)
        if MANIFEST_NAME not in names:
            return FolderState(frozenset(), False, f"{self.display} is not empty and holds no {MANIFEST_NAME} "
                                             "(not a batchgen output folder)")
        try:
            manifest = json.loads(self.storage.read_text(MANIFEST_NAME))
            previous = manifest["config_hash"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return FolderState(frozenset(), False, f"{self.display}/{MANIFEST_NAME} is unreadable ({exc})")
        if previous != config_hash:
            return FolderState(frozenset(), False, f"{self.display} holds the output of a different job config "
                                             f"(config_hash {previous[:12]}, this job {config_hash[:12]})")
        return FolderState(parts, SUCCESS_NAME in names, None)

    def prepare(self, job_name: str, config_hash: str, unit_names: list[str], overwrite: bool) -> FolderState:
        """Check the folder (JobError when it is someone else's), clear it on overwrite, write the manifest.

        A _SUCCESS beside missing unit files is removed: the run that follows redoes them.
        """
        state = self.state(config_hash)
        if state.refusal and not overwrite:
            raise JobError(f"output.path: {state.refusal}; pass --overwrite to replace it, "
                           "or choose another output.path")
        if overwrite:
            self.clear()
            state = FolderState(frozenset(), False, None)
        if state.is_complete(unit_names):
            return state
        if state.has_success:
            self.storage.remove(SUCCESS_NAME)
            state = FolderState(state.done_names, False, None)
        self.storage.remove_stale_temps()
        self.storage.write_text_atomic(MANIFEST_NAME, json.dumps({"job": job_name, "config_hash": config_hash}))
        return state

    def clear(self) -> None:
        """Remove what batchgen wrote here (unit files, manifest, _SUCCESS, temp files); nothing else."""
        for name in self.storage.list_names():
            is_temp = name.startswith(TEMP_PREFIX) and name.endswith(TEMP_SUFFIX)
            if _PART_RE.fullmatch(name) or name in (MANIFEST_NAME, SUCCESS_NAME) or is_temp:
                self.storage.remove(name)

    def write_success(self, record: dict) -> str:
        return self.storage.write_text_atomic(SUCCESS_NAME, json.dumps(record, indent=2) + "\n")

    def read_success(self) -> dict:
        return json.loads(self.storage.read_text(SUCCESS_NAME))
