"""The output folder is the truth: which units are done, whose job it holds, whether it is complete.

Files: part-NNNNN.parquet (one per finished unit), `_commits/part-NNNNN.json` (what each part holds,
written after it: see commits.py), `_batchgen.json` (the job name, config hash and the input's
fingerprint, written when a run starts, so a later run can tell "resume this" from "a different job"
or "a changed input"), `_batchgen.lock` (the run lock, see lock.py), `_batchgen.shards.json` and
`_workers/` (static shards: their count and per-shard summaries, see shards.py), with output.format
openai_batch `output.jsonl` and `errors.jsonl` (assembled from the parts just before _SUCCESS, see
batch_output.py) and `_SUCCESS` (written last).
Names starting with _ or . are skipped by Parquet dataset readers.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

import fsspec.utils

from batchgen.pipeline.batch_output import ERRORS_JSONL, OUTPUT_JSONL
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.output.checkpoints import CHECKPOINTS_DIR, part_to_checkpoint
from batchgen.pipeline.output.commits import COMMITS_DIR, CommitRecord, read_records, record_name, verify_part
from batchgen.pipeline.output.fingerprint import FileFingerprint, describe_changes, to_manifest
from batchgen.pipeline.output.units import WorkUnit
from batchgen.pipeline.run_record import RunRecord
from batchgen.pipeline.storage import Storage, is_temp_name

MANIFEST_NAME = "_batchgen.json"
SUCCESS_NAME = "_SUCCESS"
REPORT_NAME = "report.html"  # `batchgen run --report` writes the run's page beside _SUCCESS
SHARDS_MANIFEST_NAME = "_batchgen.shards.json"  # static shards: how many the folder was started with
WORKERS_DIR = "_workers"  # one summary per shard / Ray driver run (merged into _SUCCESS)
_PART_RE = re.compile(r"part-\d{5,}\.parquet")
_LOCK_RE = re.compile(r"_batchgen\.(shard-.+\.)?lock(\.shared-.+)?")


def _is_bookkeeping(name: str) -> bool:
    """Ours, but says nothing about whose output the folder holds (a run may stop before its manifest)."""
    return (is_temp_name(name) or _LOCK_RE.fullmatch(name) is not None or name == COMMITS_DIR
            or name.startswith("_batchgen.probe-"))  # the Ray driver's shared-folder probe (shared_storage.py)


@dataclass(frozen=True)
class FolderState:
    """What the folder holds for this job: verified unit files, _SUCCESS, or someone else's output."""

    done_names: frozenset[str]  # unit files whose commit record they match (none counted in a refused folder)
    has_success: bool  # _SUCCESS present (written by this very config)
    refusal: str | None  # why this folder may not be resumed (None: it is ours or empty)
    redo: dict[str, str] = field(default_factory=dict)  # unit files present but not trusted -> why
    has_manifest: bool = False
    # Parts of a smaller run of this job (--limit) that cover the first rows of a unit this run plans
    # whole: their rows are reused (prepare turns them into checkpoints) -> the committed (smaller) unit.
    grown: dict[str, WorkUnit] = field(default_factory=dict)
    is_manifest_current: bool = True  # the manifest's units are this plan's (not a smaller or larger run's)

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
        redo = f"; {describe_redo(self.redo)}" if self.redo else ""
        if self.grown:
            redo += (f"; {len(self.grown)} part(s) of a run over fewer rows (--limit) grow: their "
                     f"{sum(u.num_rows for u in self.grown.values()):,} input rows are reused, not generated again")
        if num_done or self.redo or self.grown:
            return f"resume: {num_done} of {num_units} units done, {num_units - num_done} to run{redo}"
        return "new"


def raise_if_refused(state: FolderState) -> None:
    if state.refusal:
        raise JobError(f"output.path: {state.refusal}; pass --overwrite to start over "
                       "(it deletes this folder's batchgen files), or choose another output.path")


def describe_redo(redo: dict[str, str]) -> str:
    return (f"{len(redo)} part(s) failed verification and will be run again: "
            + "; ".join(f"{name} ({why})" for name, why in sorted(redo.items())))


class OutputFolder:
    def __init__(self, storage: Storage):
        self.storage = storage

    @property
    def display(self) -> str:
        return self.storage.url

    def state(self, config_hash: str, fingerprint: list[FileFingerprint], units: list[WorkUnit]) -> FolderState:
        """Whose output this is, whether its input is unchanged, and which unit files can be trusted."""
        entries = self.storage.list_entries()
        names = [n for n in entries if not _is_bookkeeping(n)]
        if not names:
            return FolderState(frozenset(), False, None)
        if MANIFEST_NAME not in names:
            return FolderState(frozenset(), False, f"{self.display} is not empty and holds no {MANIFEST_NAME} "
                                                   "(not a batchgen output folder)")
        try:
            manifest = json.loads(self.storage.read_text(MANIFEST_NAME))
            previous = manifest["config_hash"]
            recorded = manifest.get("input")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return FolderState(frozenset(), False, f"{self.display}/{MANIFEST_NAME} is unreadable ({exc})")
        if previous != config_hash:
            return FolderState(frozenset(), False, f"{self.display} holds the output of a different job config "
                                                   f"(config_hash {previous[:12]}, this job {config_hash[:12]})")
        refusal = _input_refusal(self.display, recorded, fingerprint)
        if refusal:
            return FolderState(frozenset(), False, refusal)
        planned = {u.output_name: u for u in units}
        num_planned_rows = sum(u.num_rows for u in units)
        recorded_rows = (manifest.get("units") or {}).get("num_rows") if isinstance(manifest, dict) else None
        larger = (f"{self.display} holds a run of this job over more input rows ({recorded_rows:,}) than this run "
                  f"covers ({num_planned_rows:,}): run with a --limit of at least {recorded_rows:,}, or without "
                  "--limit" if isinstance(recorded_rows, int) else "")
        strangers = sorted(n for n in names if _PART_RE.fullmatch(n) and n not in planned)
        if strangers:
            if isinstance(recorded_rows, int) and recorded_rows > num_planned_rows:
                return FolderState(frozenset(), False, larger)
            return FolderState(frozenset(), False, f"{self.display} holds unit files this job does not plan "
                                                   f"({', '.join(strangers[:5])}): not batchgen's")
        records = read_records(self.storage)
        done, redo, grown = set(), {}, {}
        for name in names:
            if name not in planned:
                continue
            unit, record = planned[name], records.get(name)
            if isinstance(record, CommitRecord) and _is_cut_from(record, unit, config_hash) and record.stop > unit.stop:
                # A larger run's whole unit: generating this run's shorter one would replace it.
                return FolderState(frozenset(), False, larger or f"{self.display}/{name} holds more rows of "
                                                                 "this job than this run plans for it")
            why = verify_part(self.storage, unit, entries[name], record, config_hash)
            if why is None:
                done.add(name)
            elif isinstance(record, CommitRecord) and _is_cut_from(record, unit, config_hash):
                committed = WorkUnit(unit.index, unit.file, record.start, record.stop)
                if verify_part(self.storage, committed, entries[name], record, config_hash) is None:
                    grown[name] = committed
                else:
                    redo[name] = why
            else:
                redo[name] = why
        is_current = recorded_rows == num_planned_rows and (manifest.get("units") or {}).get("count") == len(units)
        return FolderState(frozenset(done), SUCCESS_NAME in names, None, redo, has_manifest=True, grown=grown,
                           is_manifest_current=is_current)

    def prepare(self, job_name: str, config_hash: str, fingerprint: list[FileFingerprint], units: list[WorkUnit],
                overwrite: bool) -> FolderState:
        """Check the folder (JobError when it may not be resumed), clear it on overwrite, write the manifest.

        The caller holds the folder's exclusive lock, so no other run writes here: temp files left by
        killed runs are removed. A _SUCCESS beside missing or untrusted unit files is removed, and so
        are the records of untrusted parts: the run that follows redoes those units.
        """
        state = self.state(config_hash, fingerprint, units)
        if not overwrite:
            raise_if_refused(state)
        if overwrite:
            self.clear()
            state = FolderState(frozenset(), False, None)
        self.storage.remove_leftover_temps(("", COMMITS_DIR, CHECKPOINTS_DIR))
        if state.is_complete([u.output_name for u in units]):
            return state
        if state.has_success:
            self.storage.remove(SUCCESS_NAME)
        for name in (OUTPUT_JSONL, ERRORS_JSONL):  # made again from the parts before the next _SUCCESS
            if self.storage.fs.exists(self.storage.join(name)):
                self.storage.remove(name)
        for name in state.redo:
            if self.storage.fs.exists(self.storage.join(record_name(name))):
                self.storage.remove(record_name(name))
        redo = dict(state.redo)
        redo.update(grow_parts(self.storage, state.grown, config_hash))
        if not state.has_manifest or not state.is_manifest_current:  # new, or this run covers more rows
            self.storage.write_text_atomic(MANIFEST_NAME, manifest_text(job_name, config_hash, fingerprint, units))
        return FolderState(state.done_names, False, None, redo, has_manifest=True)

    def clear(self) -> None:
        """Remove what batchgen wrote here (unit files, records, manifests, summaries, _SUCCESS, the .jsonl
        outputs, the report page, temp files); not the locks."""
        for name in self.storage.list_names():
            if _PART_RE.fullmatch(name) or name in (MANIFEST_NAME, SUCCESS_NAME, SHARDS_MANIFEST_NAME, OUTPUT_JSONL,
                                                    ERRORS_JSONL, REPORT_NAME) \
                    or is_temp_name(name):
                self.storage.remove(name)
        self.storage.remove_tree(COMMITS_DIR)
        self.storage.remove_tree(CHECKPOINTS_DIR)
        self.storage.remove_tree(WORKERS_DIR)

    def write_success(self, record: RunRecord) -> str:
        return self.storage.write_text_atomic(SUCCESS_NAME, record.to_json())

    def read_success(self) -> RunRecord:
        return RunRecord.from_json(self.storage.read_text(SUCCESS_NAME))


def _is_cut_from(record: CommitRecord, unit: WorkUnit, config_hash: str) -> bool:
    """The record is of this unit's part, in this job, from the same first row, with another last row:
    the same unit cut at another --limit."""
    return (record.part, record.unit, record.input_file, record.start, record.config_hash) == (
        unit.output_name, unit.index, unit.file.display, unit.start, config_hash) and record.stop != unit.stop


def grow_parts(storage: Storage, grown: dict[str, WorkUnit], config_hash: str) -> dict[str, str]:
    """Turn each part of a run over fewer rows into a checkpoint file, then remove the part and its record
    (in that order: a crash in between leaves rows in both, never in neither). Returns the parts that could
    not be turned (they are generated again) -> why."""
    redo = {}
    for name, committed in sorted(grown.items()):
        if not part_to_checkpoint(storage, name, committed.file.display, committed.start, committed.stop,
                                  config_hash):
            redo[name] = "a part of a run over fewer rows whose rows do not map one request per input row"
        if storage.fs.exists(storage.join(record_name(name))):
            storage.remove(record_name(name))
        storage.remove(name)
    return redo


def manifest_text(job_name: str, config_hash: str, fingerprint: list[FileFingerprint], units: list[WorkUnit]) -> str:
    """`_batchgen.json`: whose output this is, the input's fingerprint, and how many units the job plans
    (so `batchgen finalize` can tell a complete folder from the folder alone)."""
    manifest = {"job": job_name, "config_hash": config_hash, "input": {"files": to_manifest(fingerprint)},
                "units": {"count": len(units), "num_rows": sum(u.num_rows for u in units)}}
    return json.dumps(manifest, indent=1) + "\n"


def _input_refusal(display: str, recorded: dict | None, fingerprint: list[FileFingerprint]) -> str | None:
    if not isinstance(recorded, dict) or not isinstance(recorded.get("files"), list):
        return (f"{display}/{MANIFEST_NAME} records no input fingerprint (an older batchgen wrote it), so a "
                "resume cannot tell whether the input changed")
    try:
        before = [FileFingerprint.from_dict(f) for f in recorded["files"]]
    except (KeyError, TypeError, ValueError) as exc:
        return f"{display}/{MANIFEST_NAME} has an unreadable input fingerprint ({exc})"
    changes = describe_changes(before, fingerprint)
    if changes:
        return (f"the input changed since {display} was started, so its units would no longer be the same "
                f"rows: {'; '.join(changes)}")
    return None


def check_output_outside_input(output: Storage, input_storage: Storage) -> None:
    """JobError when the output folder is the input, or inside it (a rerun would read its own output)."""
    if output.protocol != input_storage.protocol:
        return
    out, inp = output.root.rstrip("/"), input_storage.root.rstrip("/")
    if output.is_local:
        out = os.path.realpath(out)
        inp = _realpath_keeping_magic(inp)
    if _has_magic(inp):
        pattern = re.compile(fsspec.utils.glob_translate(inp))
        is_inside = bool(pattern.match(out) or pattern.match(f"{out}/part-00000.parquet"))
    else:
        is_inside = out == inp or out.startswith(inp + "/")
    if is_inside:
        raise JobError(f"output.path: {output.url} is inside input.path {input_storage.url}: a rerun would read "
                       "its own output as input; choose an output.path outside the input")


def _has_magic(path: str) -> bool:
    return any(c in path for c in "*?[")


def _realpath_keeping_magic(path: str) -> str:
    parts = path.split("/")
    num_plain = next((i for i, p in enumerate(parts) if _has_magic(p)), len(parts))
    head = os.path.realpath("/".join(parts[:num_plain]) or "/")
    return "/".join([head, *parts[num_plain:]]) if num_plain < len(parts) else head
