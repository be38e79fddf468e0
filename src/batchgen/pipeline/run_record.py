"""The run record: what `_SUCCESS` says of a finished job, typed once.

`RunRecord.of_run` builds it from the run's counters; the writers (a local run, the Ray driver,
`finalize_folder` after static shards) write `to_json()` as `_SUCCESS`, last; a rerun of a complete
job, `batchgen finalize`, the report and the bench read it back with `from_json` / `from_dict`. The
JSON keys are user-facing (the output reference, docs/reference/output.md): the field names below, in this order.
Counts cover the whole output; speed and latency figures cover the last run.

The first batchgen wrote 13 keys (job ... resumed): a record without one of them is refused
(`RecordError`). The keys added since (model, generation_config, kernels, kv_cache, weights, workers,
speculative, structured, metrics) read as their defaults when absent: a folder finished by an older batchgen
still reads. Keys this version does not know are ignored. Values are kept as written (an integer
stays an integer), so `from_dict(d).to_dict() == d` for every record this version writes.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

if TYPE_CHECKING:
    from batchgen.pipeline.summary import Totals


class RecordError(ValueError):
    """A `_SUCCESS` that is not a run record (not a JSON object, or a required key missing)."""


def _plain(value: object) -> object:
    """A field's JSON value: nested records as their dicts, lists and dicts item by item."""
    if dataclasses.is_dataclass(value):
        return value.to_dict()
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _fields_dict(obj: object) -> dict[str, Any]:
    return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}


def _known(cls: type, data: object, what: str) -> dict[str, Any]:
    """The keys of the JSON object `data` that are fields of `cls` (newer keys are ignored)."""
    if not isinstance(data, dict):
        raise RecordError(f"{what} is not a JSON object (got {type(data).__name__})")
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in data.items() if k in names}


def _construct(cls: type, values: dict[str, Any], what: str):
    """cls(**values), a missing key named as a RecordError."""
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in values
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise RecordError(f"{what} has no {', '.join(missing)}")
    return cls(**values)


def _empty_for_null(values: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """The engine's reports (kernels, kv_cache, weights) are written as {} when it had none; null reads as {}."""
    return {k: {} if k in names and v is None else v for k, v in values.items()}


class _Part:
    """A part of the record: written as its fields in order, read back naming what is missing."""

    WHAT: ClassVar[str]  # how an error names it

    def to_dict(self) -> dict[str, Any]:
        return _fields_dict(self)

    @classmethod
    def from_dict(cls, data: object, what: str | None = None):
        what = what or cls.WHAT
        return _construct(cls, _known(cls, data, what), what)


@dataclass(frozen=True, kw_only=True)
class Percentiles(_Part):
    """A latency's percentiles over the rows that have it, in seconds."""

    WHAT = "a percentiles entry"

    p50: float | None = None
    """The median; None when no row has the figure (every figure is then None)."""
    p90: float | None = None
    """The 90th percentile."""
    p99: float | None = None
    """The 99th percentile."""

    @classmethod
    def of(cls, chunks: list[np.ndarray]) -> Percentiles:
        """Over every value of `chunks` (arrays of per-row seconds, nulls dropped already)."""
        values = np.concatenate(chunks) if chunks else np.array([])
        if values.size == 0:
            return cls()
        p50, p90, p99 = np.percentile(values, [50, 90, 99])
        return cls(p50=float(p50), p90=float(p90), p99=float(p99))


@dataclass(frozen=True, kw_only=True)
class GenerationDefaults(_Part):
    """What the job's `model.generation_config` gave it: the sampling defaults read from the model's file."""

    WHAT = "generation_config"

    setting: str
    """The job's model.generation_config (auto | vllm | a folder)."""
    file: str | None = None
    """The generation_config.json read; None when none was."""
    applied: dict[str, Any] = field(default_factory=dict)
    """The sampling keys it set (those the job file left unset) and their values."""


@dataclass(frozen=True, kw_only=True)
class SpeculativeFigures(_Part):
    """Draft and accepted tokens of speculative decoding over a run (summed over its workers)."""

    WHAT = "speculative"

    num_draft_tokens: int
    """Tokens the drafter proposed."""
    num_accepted_tokens: int
    """Draft tokens the target model accepted."""
    num_verifies: int
    """Target steps that verified drafts."""
    acceptance_rate: float | None = None
    """num_accepted_tokens / num_draft_tokens; None without drafts."""
    mean_accepted_length: float | None = None
    """Tokens emitted per verify, the target's own included (vLLM's definition); None without verifies."""

    @classmethod
    def of_counts(cls, drafted: int, accepted: int, verifies: int) -> SpeculativeFigures:
        """The figures with their rates computed from the counts."""
        return cls(num_draft_tokens=drafted, num_accepted_tokens=accepted, num_verifies=verifies,
                   acceptance_rate=accepted / drafted if drafted else None,
                   mean_accepted_length=1 + accepted / verifies if verifies else None)


@dataclass(frozen=True, kw_only=True)
class MetricFigures(_Part):
    """One eval metric over the whole output (the job's `metrics:`; batchgen.metrics.aggregate)."""

    WHAT = "metrics"

    value: float | None
    """The mean verdict over rows (pass@k: the mean pass@k over ids); None when nothing was scored."""
    stderr: float | None
    """Its standard error (lm-eval's: sample standard deviation / sqrt(n)); None when nothing was scored."""
    n: int
    """Rows scored (pass@k: ids)."""


@dataclass(frozen=True, kw_only=True)
class StructuredFigures(_Part):
    """Constrained (structured-output) requests of a run and what their token mask cost."""

    WHAT = "structured"

    num_constrained_requests: int
    """Requests that carried a grammar, a JSON schema, a regex or a choice list."""
    num_masked_steps: int
    """Engine steps that applied a token mask."""
    num_masked_rows: int
    """Constrained rows masked, over those steps."""
    mask_seconds: float
    """Host time spent on the masks (fill, copy, apply)."""
    num_compiles: int
    """Grammars compiled (a cache hit compiles nothing)."""
    compile_seconds: float
    """Time spent compiling them."""
    mask_ms_per_step: float | None = None
    """1000 x mask_seconds / num_masked_steps; None without masked steps."""
    masked_rows_per_step: float | None = None
    """num_masked_rows / num_masked_steps; None without masked steps."""

    COUNTS: ClassVar[tuple[str, ...]] = ("num_constrained_requests", "num_masked_steps", "num_masked_rows", "mask_seconds", "num_compiles",
                                         "compile_seconds")

    @classmethod
    def of_counts(cls, counts: dict[str, float]) -> StructuredFigures:
        """The figures with their per-step rates computed from the counts (the COUNTS keys)."""
        steps = counts["num_masked_steps"]
        return cls(**{k: counts[k] for k in cls.COUNTS},
                   mask_ms_per_step=1000 * counts["mask_seconds"] / steps if steps else None,
                   masked_rows_per_step=counts["num_masked_rows"] / steps if steps else None)


@dataclass(frozen=True, kw_only=True)
class ShardPlacement(_Part):
    """Where one static shard ran and what it did, in its last run."""

    WHAT = "a shard placement"

    index: int
    """The shard's index I of --shard I/N."""
    source: str
    """Where the index came from: --shard, SLURM_ARRAY_TASK_ID or JOB_COMPLETION_INDEX."""
    host: str | None = None
    """The host it ran on."""
    units_run: int = 0
    """Units it generated."""
    units_skipped: int = 0
    """Its units an earlier run had committed."""


@dataclass(frozen=True, kw_only=True)
class ReplicaPlacement(_Part):
    """Where one Ray replica ran."""

    WHAT = "a replica placement"

    host: str
    """The node's host name."""
    pid: int
    """The actor's process id."""


# Keys written only for the backends that have them (absent otherwise, as they always were).
_BACKEND_KEYS = ("num_shards", "gpus_per_replica", "shards", "replicas")


@dataclass(frozen=True, kw_only=True)
class Workers(_Part):
    """How the job ran: one local process, static shards, or Ray replicas, with failures and retries."""

    WHAT = "workers"

    backend: str
    """local | shards | ray."""
    num_shards: int | None = None
    """Static shards: N of --shard I/N (absent for the other backends)."""
    num_workers: int = 1
    """Processes that ran units: 1, the shards, or the replicas."""
    gpus_per_replica: float | None = None
    """Ray: GPUs each replica held (0 on a CPU cluster; absent for the other backends)."""
    replica_failures: int = 0
    """Ray: replicas that died; shards: shard runs that found part of their shard done (a run before stopped)."""
    units_retried: list[str] = field(default_factory=list)
    """Part names run again after a failure."""
    shards: list[ShardPlacement] | None = None
    """Static shards: each shard's placement, by index (absent for the other backends)."""
    replicas: list[ReplicaPlacement] | None = None
    """Ray: each replica started, in start order (absent for the other backends)."""

    @classmethod
    def local(cls) -> Workers:
        """A run in one process (no shards, no replicas)."""
        return cls(backend="local")

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in _fields_dict(self).items() if not (k in _BACKEND_KEYS and v is None)}

    @classmethod
    def from_dict(cls, data: object, what: str | None = None) -> Workers:
        values = _known(cls, data, what or cls.WHAT)
        for name, part in (("shards", ShardPlacement), ("replicas", ReplicaPlacement)):
            if values.get(name) is not None:
                values[name] = [part.from_dict(item) for item in values[name]]
        return _construct(cls, values, what or cls.WHAT)


_ENGINE_REPORTS = ("kernels", "kv_cache", "weights")


@dataclass(frozen=True, kw_only=True)
class EngineReport(_Part):
    """What a run's engine says of itself: the model it loaded and its stats' kernels, KV cache and weights."""

    WHAT = "an engine report"

    model: str | None = None
    """The model path as the job names it; None when no engine ran."""
    kernels: dict[str, Any] = field(default_factory=dict)
    """The implementations that ran (the engine's Capabilities)."""
    kv_cache: dict[str, Any] = field(default_factory=dict)
    """The KV cache's dtype and bytes per token."""
    weights: dict[str, Any] = field(default_factory=dict)
    """The weight format, its origin and the decoder's linear bytes (engine/quant/weight_report.py)."""

    @classmethod
    def from_dict(cls, data: object, what: str | None = None) -> EngineReport:
        return cls(**_empty_for_null(_known(cls, data, what or cls.WHAT), _ENGINE_REPORTS))


@dataclass(frozen=True, kw_only=True)
class RunRecord(_Part):
    """`_SUCCESS`: what a finished job produced and how it ran. The field order is the file's key order
    (`to_dict()`: the JSON object; `to_json()`: the file's text)."""

    WHAT = "_SUCCESS"

    job: str
    """The job's name."""
    config_hash: str
    """Hash over model, input, sampling and sampling_columns (what changes outputs; not engine knobs, not
    output.path)."""
    model: str | None = None
    """The model path the engine loaded, as the job names it (a report compares tokenizers by it)."""
    generation_config: GenerationDefaults | None = None
    """The sampling defaults model.generation_config gave the job."""
    num_requests: int
    """Requests in the whole output (a request is its sample_index 0 row)."""
    num_rows: int
    """Output rows: one per (request, sample)."""
    num_errors: int
    """Requests that failed (each wrote n error rows)."""
    finish_reasons: dict[str, int] = field(default_factory=dict)
    """Output rows by finish_reason (stop, length, error, ...), most first; {} in older records."""
    error_reasons: dict[str, int] = field(default_factory=dict)
    """The failed requests' five most frequent error messages, numbers masked as N (so one cause counts
    once), with their request counts, most first; {} in older records and runs without errors."""
    prompt_tokens: int
    """Prompt tokens, summed over requests."""
    cached_tokens: int
    """Prompt tokens served from the prefix cache, summed over requests."""
    completion_tokens: int
    """Completion tokens, summed over rows."""
    generation_seconds: float
    """Wall seconds the last run spent generating (after the engine started)."""
    completion_tokens_per_s: float
    """The last run's completion tokens / generation_seconds (0 when nothing ran)."""
    ttft_s: Percentiles
    """Time to first token over the last run's rows."""
    tpot_s: Percentiles
    """Time per output token over the last run's rows with at least 2 tokens."""
    resumed: bool
    """An earlier run did part of the work: counts then cover the whole output, speed figures the last run."""
    kernels: dict[str, Any] = field(default_factory=dict)
    """The implementations the engine used (its stats' `kernels`)."""
    kv_cache: dict[str, Any] = field(default_factory=dict)
    """The KV cache: dtype, bytes per token, the pool's tokens and bytes (its stats' `kv_cache`), and `sizing`: how
    kv_cache_memory auto sized it for the job, where it did."""
    weights: dict[str, Any] = field(default_factory=dict)
    """The weight format and the decoder's linear bytes (its stats' `weights`)."""
    workers: Workers | None = None
    """How the job ran; None in a record older than the key."""
    speculative: SpeculativeFigures | None = None
    """The last run's draft and accepted tokens; None with speculation off."""
    structured: StructuredFigures | None = None
    """The last run's constrained requests and mask time; None when no request was constrained."""
    metrics: dict[str, MetricFigures] = field(default_factory=dict)
    """The job's eval metrics over the whole output, by name: value, stderr, n (empty without metrics)."""
    select: dict[str, Any] | None = None
    """A select stage of a multi-stage job: its rule and what it counted (input rows, prompts, rows `where`
    dropped, unscored rows, output rows; dpo_pairs: prompts dropped as single, tied or below min_margin and
    the kept pairs' margin percentiles); None for a model stage or job."""
    provenance: dict[str, Any] = field(default_factory=dict)
    """How the output was made, fully resolved (pipeline/provenance.py): batchgen version, model files and
    settings, engine settings, every sampling key, input settings, chat template hash; {} in older records."""

    @classmethod
    def of_run(cls, job: str, config_hash: str, *, whole: Totals, this_run: Totals, generation_seconds: float,
               resumed: bool, engine: EngineReport, generation_config: GenerationDefaults | None = None,
               workers: Workers | None = None, speculative: SpeculativeFigures | None = None,
               structured: StructuredFigures | None = None, provenance: dict[str, Any] | None = None) -> RunRecord:
        """The record of a run: counts over `whole` (every part of the output), speed and latency over
        `this_run` (what this run generated in `generation_seconds`); `workers` None: one local process."""
        return cls(
            job=job, config_hash=config_hash, model=engine.model, generation_config=generation_config,
            num_requests=whole.num_requests, num_rows=whole.num_rows, num_errors=whole.num_errors,
            finish_reasons=whole.finish_reasons_by_count(), error_reasons=whole.top_error_reasons(),
            prompt_tokens=whole.prompt_tokens, cached_tokens=whole.cached_tokens,
            completion_tokens=whole.completion_tokens, generation_seconds=generation_seconds,
            completion_tokens_per_s=this_run.completion_tokens / generation_seconds if generation_seconds > 0 else 0.0,
            ttft_s=Percentiles.of(this_run.ttft_s), tpot_s=Percentiles.of(this_run.tpot_s), resumed=resumed,
            kernels=engine.kernels, kv_cache=engine.kv_cache, weights=engine.weights,
            workers=workers if workers is not None else Workers.local(), speculative=speculative,
            structured=structured, metrics=whole.metric_scores(), provenance=dict(provenance or {}))

    def to_dict(self) -> dict[str, Any]:
        values = _fields_dict(self)
        if values["select"] is None:  # written by select stages only (absent elsewhere, as it always was)
            del values["select"]
        return values

    def to_json(self) -> str:
        """The `_SUCCESS` file's text."""
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, data: object, what: str | None = None) -> RunRecord:
        """A record read back (RecordError when it is not one; see the module docstring for older records)."""
        values = _empty_for_null(_known(cls, data, cls.WHAT), _ENGINE_REPORTS)
        for name in ("ttft_s", "tpot_s"):
            if name in values:
                values[name] = Percentiles.from_dict(values[name], name)
        optional = {"generation_config": GenerationDefaults, "workers": Workers, "speculative": SpeculativeFigures,
                    "structured": StructuredFigures}
        for name, part in optional.items():
            if values.get(name) is not None:
                values[name] = part.from_dict(values[name])
        if isinstance(values.get("metrics"), dict):
            values["metrics"] = {name: MetricFigures.from_dict(v, f"metrics.{name}")
                                 for name, v in values["metrics"].items()}
        return _construct(cls, values, cls.WHAT)

    @classmethod
    def from_json(cls, text: str) -> RunRecord:
        """A `_SUCCESS` file's text read back (RecordError when it is not JSON or lacks a required key)."""
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise RecordError(f"_SUCCESS is not JSON ({exc})") from None
        return cls.from_dict(data)
