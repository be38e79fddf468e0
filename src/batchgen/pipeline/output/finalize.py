"""`_SUCCESS` from the folder alone: every planned unit committed -> the merged summary, created once.

Used by the shard that finds the last unit committed, and by `batchgen finalize OUT` by hand. The
folder says everything needed: `_batchgen.json` (the config hash and how many units the job plans),
the commit records and parts (verified as a resume verifies them), and `_workers/` (each worker's
summary: when it ran, what it generated, how it was placed). Counts and latency percentiles cover
every row of every part; the speed is the workers' completion tokens over the span from the first
worker's start to the last one's end.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pyarrow.parquet as pq

from batchgen.pipeline.batch_output import LINE_COLUMN, write_batch_outputs
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.input_file import InputFile
from batchgen.pipeline.output.checkpoints import remove_checkpoints
from batchgen.pipeline.output.commits import CommitRecord, read_records, verify_part
from batchgen.pipeline.output.create_once import create_text_once
from batchgen.pipeline.output.folder import MANIFEST_NAME, SUCCESS_NAME, WORKERS_DIR
from batchgen.pipeline.output.units import WorkUnit, unit_file_name
from batchgen.pipeline.run_record import (
    EngineReport,
    GenerationDefaults,
    RunRecord,
    ShardPlacement,
    SpeculativeFigures,
    StructuredFigures,
    Workers,
)
from batchgen.pipeline.storage import Storage
from batchgen.pipeline.summary import Totals, merge_speculative, merge_structured, read_summary_table


@dataclass
class Finalized:
    record: RunRecord | None  # the _SUCCESS contents; None while units are missing
    created: bool  # this call wrote _SUCCESS (False: it was there already, or units are missing)
    missing: list[str]  # part names not (trustworthily) committed yet


def read_manifest(storage: Storage) -> dict:
    try:
        return json.loads(storage.read_text(MANIFEST_NAME))
    except FileNotFoundError:
        raise JobError(f"{storage.url} holds no {MANIFEST_NAME}: not a batchgen output folder") from None
    except (OSError, ValueError) as exc:
        raise JobError(f"{storage.url}/{MANIFEST_NAME} is unreadable ({exc})") from None


def missing_units(storage: Storage, manifest: dict) -> list[str]:
    """Planned part names whose part is absent or does not match its commit record."""
    units = manifest.get("units")
    if not isinstance(units, dict) or not isinstance(units.get("count"), int):
        raise JobError(f"{storage.url}/{MANIFEST_NAME} does not say how many units the job plans (an older "
                       "batchgen wrote it): rerun the job instead, which writes _SUCCESS itself")
    config_hash = manifest["config_hash"]
    records = read_records(storage)
    entries = storage.list_entries()
    missing = []
    num_rows = 0
    for index in range(units["count"]):
        name = unit_file_name(index)
        record = records.get(name)
        if name not in entries or not isinstance(record, CommitRecord):
            missing.append(name)
            continue
        unit = WorkUnit(index, InputFile("", record.input_file, 0, None), record.start, record.stop)
        if verify_part(storage, unit, entries[name], record, config_hash) is not None:
            missing.append(name)
            continue
        num_rows += record.stop - record.start
    if not missing and num_rows != units.get("num_rows", num_rows):
        raise JobError(f"{storage.url}: the commit records cover {num_rows:,} input rows, the job plans "
                       f"{units['num_rows']:,}")
    return missing


def read_worker_summaries(storage: Storage) -> list[dict]:
    summaries = []
    for name in storage.list_names(WORKERS_DIR):
        if name.endswith(".json") and not name.startswith("."):
            try:
                summaries.append(json.loads(storage.read_text(f"{WORKERS_DIR}/{name}")))
            except (OSError, ValueError):
                continue  # a summary only feeds the speed figures; the counts come from the parts
    return summaries


def merged_record(storage: Storage, manifest: dict, workers: Workers, summaries: list[dict]) -> RunRecord:
    """The _SUCCESS of a job run by several workers: counts and latency over every part's rows."""
    whole = Totals()
    for index in range(manifest["units"]["count"]):
        with storage.fs.open(storage.join(unit_file_name(index)), "rb") as f:
            whole.add_table(read_summary_table(f))
    generated = Totals(completion_tokens=sum(s.get("generated_completion_tokens", 0) for s in summaries),
                       ttft_s=whole.ttft_s, tpot_s=whole.tpot_s)
    starts = [s["started"] for s in summaries if s.get("started")]
    ends = [s["finished"] for s in summaries if s.get("finished")]
    span = max(ends) - min(starts) if starts and ends else 0.0
    resumed = any(s.get("resumed") for s in summaries)
    # Every worker loads the same job: the first that ran an engine speaks for all.
    engine = next((s["engine"] for s in summaries if s.get("engine", {}).get("kernels")), {})
    generation = next((s["generation_config"] for s in summaries if s.get("generation_config")), None)
    return RunRecord.of_run(
        manifest.get("job", ""), manifest["config_hash"], whole=whole, this_run=generated, generation_seconds=span,
        resumed=resumed, engine=EngineReport.from_dict(engine), workers=workers,
        generation_config=GenerationDefaults.from_dict(generation) if generation else None,
        speculative=merge_speculative([_part(SpeculativeFigures, s.get("speculative")) for s in summaries]),
        structured=merge_structured([_part(StructuredFigures, s.get("structured")) for s in summaries]),
        provenance=next((s["provenance"] for s in summaries if s.get("provenance")), None))


def _part(kind: type, value: dict | None):
    """A worker summary's speculative or structured figures, typed (None: none)."""
    return None if value is None else kind.from_dict(value)


def finalize_folder(storage: Storage, workers: Workers | None = None) -> Finalized:
    """Write `_SUCCESS` if every planned unit is committed and nobody wrote it yet (create-if-absent:
    two workers finishing together both compute it, exactly one write lands). Parts written for
    `output.format: openai_batch` (they carry the openai_line column) first get their output.jsonl and
    errors.jsonl, each written whole; workers finishing together write the same bytes."""
    manifest = read_manifest(storage)
    missing = missing_units(storage, manifest)
    if missing:
        return Finalized(None, False, missing)
    if storage.fs.exists(storage.join(SUCCESS_NAME)):
        return Finalized(RunRecord.from_json(storage.read_text(SUCCESS_NAME)), False, [])
    remove_checkpoints(storage)  # every unit is committed: what they saved is in the parts
    part_names = [unit_file_name(index) for index in range(manifest["units"]["count"])]
    if part_names and _has_openai_lines(storage, part_names[0]):
        write_batch_outputs(storage, part_names)
    summaries = read_worker_summaries(storage)
    record = merged_record(storage, manifest, workers or workers_from_summaries(summaries), summaries)
    created = create_text_once(storage, SUCCESS_NAME, record.to_json())
    if not created:
        record = RunRecord.from_json(storage.read_text(SUCCESS_NAME))
    return Finalized(record, created, [])


def workers_from_summaries(summaries: list[dict]) -> Workers:
    """`workers` of a sharded job: the shard count, where each shard came from, failures and retries."""
    shards = [s for s in summaries if s.get("shard")]
    if not shards:
        return Workers(backend="local", num_workers=max(len(summaries), 1))
    num_shards = shards[0]["shard"]["count"]
    return Workers(
        backend="shards", num_shards=num_shards, num_workers=num_shards,
        # A shard run that found part of its shard done was preceded by a run of it that stopped early.
        replica_failures=sum(1 for s in shards if s.get("resumed")),
        units_retried=sorted({u for s in shards for u in s.get("units_redone", [])}),
        shards=[ShardPlacement(index=s["shard"]["index"], source=s["shard"]["source"], host=s.get("host"),
                               units_run=len(s.get("units_run", [])), units_skipped=s.get("num_units_skipped", 0))
                for s in sorted(shards, key=lambda s: s["shard"]["index"])],
    )


def _has_openai_lines(storage: Storage, part_name: str) -> bool:
    with storage.fs.open(storage.join(part_name), "rb") as f:
        return LINE_COLUMN in pq.read_schema(f).names
