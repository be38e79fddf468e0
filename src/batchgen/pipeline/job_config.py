"""JobConfig: one job file, validated (the sections are job_sections.py's), and its config hash."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import BaseModel, Field, PrivateAttr, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from batchgen.engine.config import EngineConfig, SettingError
from batchgen.engine.decoding.structured import StructuredOutputError
from batchgen.engine.sampling.sampling_params import SamplingParams
from batchgen.metrics import MetricSpec, check_metric_name
from batchgen.metrics.spec import ChoiceAccuracy, PassAtK
from batchgen.pipeline import structured_job
from batchgen.pipeline.batch_file import BATCH_FORMAT
from batchgen.pipeline.job_sections import (
    OVERRIDABLE_SAMPLING_KEYS,
    BatchingSection,
    ClusterSection,
    EngineSection,
    InputSection,
    ModelSection,
    OutputSection,
    SamplingSection,
    Section,
)
from batchgen.pipeline.job_settings import (
    HASHED_WHEN_SET,
    KV_CACHE_HASH_KEYS,
    MODEL_KEYS,
    MODEL_PATH_FIELD,
    SAMPLING_RENAMED,
)
from batchgen.pipeline.reward_job import reward_job_errors
from batchgen.pipeline.tool_rows import check_job_tools

CONTINUATION_KEYS = ("continuations_column", "continuation_column")


class JobConfig(Section):
    """One job file, validated. Paths are resolved (relative to the job file's folder) by `load_job`."""

    name: str = Field(min_length=1)
    """The job's name: `_SUCCESS` records it, and the default output folder is out/<name>/ (default: the
    job file's name without .yaml)."""
    task: Literal["generate", "loglikelihood", "reward"] = "generate"
    """generate: each row's prompt is completed. loglikelihood (lm-evaluation-harness' name; vLLM's
    "score" is a cross-encoder's): each row's prompt is a context whose given continuations are scored.
    reward: each row's prompt and its completion (input.completion_column) are scored by a reward model
    (a `*ForSequenceClassification` checkpoint), written as `reward`."""
    model: ModelSection
    """What is loaded: EngineConfig's model fields (model.path is EngineConfig.model)."""
    engine: EngineSection = Field(default_factory=EngineSection)
    """How the engine runs: EngineConfig's other fields."""
    input: InputSection
    """The rows to run."""
    sampling: SamplingSection = Field(default_factory=SamplingSection)
    """The job's sampling defaults: SamplingParams' fields (a column named in sampling_columns overrides
    a key per row)."""
    sampling_columns: dict[str, str] = Field(default_factory=dict)
    """Sampling keys a column overrides per row, e.g. {temperature: temp_col}."""
    batching: BatchingSection = Field(default_factory=BatchingSection)
    """How requests are ordered before they reach the engine."""
    output: OutputSection = Field(default_factory=OutputSection)
    """Where and how the results are written."""
    cluster: ClusterSection = Field(default_factory=ClusterSection)
    """Where the job runs: this process or engine replicas on Ray."""
    metrics: dict[str, MetricSpec] = Field(default_factory=dict)
    """Eval metrics scored on every output row, by name: {name: {type: <metric>, <options>}} (types:
    exact_match, contains, regex_match, numeric_match, choice_accuracy, choice_accuracy_norm, pass_at_k;
    see the metrics guide). Each writes a `metric_<name>` column (1.0 right, 0.0 wrong; a failed row 0);
    `_SUCCESS` holds each one's value, stderr and n; the columns a metric reads are kept in the output."""
    # What model.generation_config filled into the sampling section (set by job_plan.plan_job).
    _generation_config: dict | None = PrivateAttr(default=None)
    # A stage of a multi-stage job: {earlier stage: its identity} of the stages it reads (pipeline/stages/),
    # part of its config hash, so a changed earlier stage reruns this one.
    _upstream_identities: dict[str, str] = PrivateAttr(default_factory=dict)
    # task: reward: the reward model's labels (set by job_plan.plan_job from its config.json).
    _num_labels: int = PrivateAttr(default=1)
    # engine.kv_cache_memory auto on the CPU: the pool sized from the job (pipeline/kv_budget.py, set by plan_job).
    _kv_budget: Any = PrivateAttr(default=None)

    @field_validator("sampling_columns")
    @classmethod
    def _check_sampling_columns(cls, value: dict[str, str]) -> dict[str, str]:
        unknown = sorted(set(value) - set(OVERRIDABLE_SAMPLING_KEYS))
        if unknown:
            raise ValueError(f"cannot override {', '.join(unknown)} per row; allowed keys: "
                             f"{', '.join(OVERRIDABLE_SAMPLING_KEYS)}")
        return value

    @field_validator("metrics")
    @classmethod
    def _check_metric_names(cls, value: dict[str, MetricSpec]) -> dict[str, MetricSpec]:
        for name in value:
            check_metric_name(name)
        return value

    @model_validator(mode="after")
    def _check_formats(self) -> JobConfig:
        if self.output.format == "auto":
            self.output.format = self.input.format
        errors = []
        if self.input.is_batch_file and self.sampling_columns:
            errors.append(_key_error(("sampling_columns",), "does not apply to input.format openai_batch: "
                                     "each line's body sets its own sampling fields", self.sampling_columns))
        errors += self._task_errors() if not self.is_reward else []
        errors += [_key_error(*error) for error in reward_job_errors(self)]
        errors += self._metric_errors()
        if self.output.parse_json and not (self.sampling.structured or {}).keys() & {"json", "json_file"}:
            errors.append(_key_error(("output", "parse_json"), "needs a JSON schema in sampling.structured (json or "
                                     "json_file): its properties are the columns", True))
        errors += [_key_error(*problem) for problem in check_job_tools(self)]
        errors += self._lora_errors()
        if self.input.is_batch_file and self.output.keep_columns:
            errors.append(_key_error(("output", "keep_columns"), "does not apply to input.format "
                                     "openai_batch: a batch file has no columns besides custom_id (the output's id)",
                                     self.output.keep_columns))
        if self.writes_batch_output and self.input.allow_duplicate_ids:
            errors.append(_key_error(("input", "allow_duplicate_ids"), "must be false with output.format "
                                     "openai_batch: each id is one line's custom_id", True))
        if errors:
            raise ValidationError.from_exception_data(type(self).__name__, errors)
        return self

    def _task_errors(self) -> list[InitErrorDetails]:
        """What a loglikelihood job needs (continuations to score) and what it cannot take."""
        inp, sampling = self.input, self.sampling
        given = [key for key in CONTINUATION_KEYS if getattr(inp, key) is not None]
        # Scoring and beam search fork sequences, whose copy on write tensor parallelism does not run yet.
        forks = ("task: loglikelihood" if self.is_scoring
                 else "sampling.beam_width > 1" if sampling.beam_width > 1 else None)
        errors = [] if forks is None or self.engine.tensor_parallel_size == 1 else [
            _key_error(("engine", "tensor_parallel_size"), f"must be 1 with {forks} (not implemented with "
                       "tensor parallelism)", self.engine.tensor_parallel_size)]
        if sampling.beam_width > 1 and inp.schema_column is not None:
            errors.append(_key_error(("input", "schema_column"), "must be null with sampling.beam_width > 1 (beams "
                                     "are not constrained)", inp.schema_column))
        if not self.is_scoring:
            return errors + [_key_error(("input", key), "applies to task: loglikelihood only", getattr(inp, key))
                             for key in given]
        if len(given) != 1:
            errors.append(_key_error(("input", "continuations_column"), "task: loglikelihood needs one of "
                                     "input.continuations_column (a list of strings per row) or "
                                     "input.continuation_column (one string)", None))
        if inp.is_batch_file:
            errors.append(_key_error(("input", "format"), "must be parquet with task: loglikelihood (an OpenAI "
                                     "batch line is a generation request)", inp.format))
        if self.output.format == BATCH_FORMAT:
            errors.append(_key_error(("output", "format"), "must be parquet with task: loglikelihood",
                                     self.output.format))
        rule = "task: loglikelihood scores the given continuations: it samples nothing, leave it at its default"
        for key in ("n", "beam_width"):
            if getattr(sampling, key) != 1:
                errors.append(_key_error(("sampling", key), f"must be 1 with task: loglikelihood ({rule})",
                                         getattr(sampling, key)))
        if sampling.logprobs not in (None, False, True, 0):
            errors.append(_key_error(("sampling", "logprobs"), "must be false or true with task: loglikelihood "
                                     "(true: each continuation token's log-probability; no top N)",
                                     sampling.logprobs))
        if self.sampling_columns:
            errors.append(_key_error(("sampling_columns",), f"does not apply to task: loglikelihood ({rule})",
                                     self.sampling_columns))
        if sampling.structured is not None:
            errors.append(_key_error(("sampling", "structured"), f"does not apply to task: loglikelihood ({rule})",
                                     sampling.structured))
        if inp.schema_column is not None:
            errors.append(_key_error(("input", "schema_column"), f"does not apply to task: loglikelihood ({rule})",
                                     inp.schema_column))
        return errors

    def _lora_errors(self) -> list[InitErrorDetails]:
        """input.lora_column names adapters of model.lora_modules; several adapters need it."""
        modules, column = self.model.lora_modules, self.input.lora_column
        if column is not None and not modules:
            return [_key_error(("input", "lora_column"), "needs model.lora_modules (the adapters its cells name)",
                               column)]
        if column is None and len(modules) > 1 and not self.input.is_batch_file:  # a batch line's model picks
            return [_key_error(("input", "lora_column"), "must name the column of each row's adapter when "
                               "model.lora_modules holds several (one adapter runs every row)", None)]
        return [_key_error(("model", "lora_modules", name), "must be a non-empty path", path)
                for name, path in modules.items() if not name or not path.strip()]

    def _metric_errors(self) -> list[InitErrorDetails]:
        """Each metric fits the task; the columns the metrics read join output.keep_columns (the report
        reads them too)."""
        errors = []
        for name, spec in self.metrics.items():
            if spec.is_choice != self.is_scoring:
                needs = "task: loglikelihood" if spec.is_choice else "task: generate (it scores a completion)"
                errors.append(_key_error(("metrics", name, "type"), f"{spec.type} needs {needs}", spec.type))
            if isinstance(spec, PassAtK) and spec.k > self.sampling.n:
                errors.append(_key_error(("metrics", name, "k"), f"must be at most sampling.n ({self.sampling.n}): "
                                         "pass@k draws k of each prompt's n samples", spec.k))
            if self.input.is_batch_file and spec.input_columns:
                errors.append(_key_error(("metrics", name), "reads input columns, which a batch file does not "
                                         "have (its lines are the only input)", spec.type))
        if errors or self.input.is_batch_file:
            return errors
        needed = [c for spec in self.metrics.values() for c in spec.input_columns]
        if any(isinstance(spec, ChoiceAccuracy) for spec in self.metrics.values()):
            needed.append(self.input.scored_column)  # labels as text, lengths for acc_norm
        for column in needed:
            if column is not None and column != self.input.id_column and column not in self.output.keep_columns:
                self.output.keep_columns.append(column)
        return errors

    @property
    def is_scoring(self) -> bool:
        """task: loglikelihood: rows score given continuations instead of generating."""
        return self.task == "loglikelihood"

    @property
    def is_reward(self) -> bool:
        """task: reward: rows are (prompt, completion) pairs scored by a reward model (reward_job.py)."""
        return self.task == "reward"

    @property
    def num_labels(self) -> int:
        """task: reward: the reward model's labels (1 until job_plan.plan_job reads its config)."""
        return self._num_labels

    @property
    def kv_budget(self):
        """The KvBudget plan_job found for engine.kv_cache_memory auto on the CPU; None otherwise."""
        return self._kv_budget

    def record_kv_budget(self, budget) -> None:
        self._kv_budget = budget

    def record_num_labels(self, num_labels: int) -> None:
        self._num_labels = num_labels

    @property
    def writes_batch_output(self) -> bool:
        """output.format openai_batch: the job also writes output.jsonl and errors.jsonl."""
        return self.output.format == BATCH_FORMAT

    @model_validator(mode="after")
    def _check_by_constructing(self) -> JobConfig:
        """The engine's checks are the job's: build what a run builds, and name the key that fails."""
        errors = []
        try:
            self.engine_config()
        except SettingError as exc:
            section = "model" if exc.name in (MODEL_PATH_FIELD, *MODEL_KEYS) else "engine"
            key = "path" if exc.name == MODEL_PATH_FIELD else exc.name
            errors.append(_key_error((section, key), exc.rule, exc.value))
        try:
            params = self.sampling_params()
        except SettingError as exc:
            errors.append(_key_error(("sampling", exc.name), exc.rule, exc.value))
        except StructuredOutputError as exc:
            errors.append(_structured_error(exc, self.sampling.structured))
        else:
            # null: checked against the model's own (preflight); a loglikelihood job generates nothing
            if self.model.max_model_len is not None and not self.is_scoring and not self.is_reward:
                rule = max_tokens_rule(params.max_tokens, self.model.max_model_len)
                if rule:
                    errors.append(_key_error(("sampling", "max_tokens"), rule, params.max_tokens))
        if errors:
            raise ValidationError.from_exception_data(type(self).__name__, errors)
        return self

    def engine_config(self) -> EngineConfig:
        """The engine's config for this job: the `model` section (path -> model) and the `engine` section."""
        model = self.model.model_dump()
        engine = self.engine.model_dump()
        adapters = model.pop("lora_modules")
        if len(adapters) == 1 and self.input.lora_column is None:  # one adapter runs every row: merged at load
            engine["merged_lora"] = next(iter(adapters.values()))
        elif adapters:  # rows of several adapters (or of the base) need the engine's LoRA layers
            engine["enable_lora"] = True
        if self._kv_budget is not None and engine["kv_cache_memory"] == "auto":
            engine["kv_cache_memory"] = self._kv_budget.num_bytes
        return EngineConfig(**{MODEL_PATH_FIELD: model.pop("path")}, **model, **engine)

    def sampling_params(self, **row_overrides: Any) -> SamplingParams:
        """The job's SamplingParams (the `sampling` section), with a row's overrides if given (a row's
        schema: `structured_outputs`)."""
        values = self.sampling.model_dump(exclude=set(SAMPLING_RENAMED))
        values["structured_outputs"] = self.sampling.constraint()
        return SamplingParams(**{**values, **row_overrides})

    def config_hash(self) -> str:
        """sha256 over what changes outputs: model, input, sampling, sampling_columns, the KV cache's
        format when not the default (engine.kv_cache_dtype, engine.calculate_kv_scales: FP8 KV changes
        the numbers) and the metrics when there are any (their verdict columns).

        Not --limit: a run over fewer rows is the same job (its rows are the full job's first rows), so a
        larger --limit or the full job resumes it; the output folder's manifest and commit records say
        which rows a folder holds.

        Engine knobs other than the KV cache's, batching, cluster, output and storage options
        (credentials) are left out; a job with the default KV cache keeps the hash it had before
        these keys existed.
        """
        # The formats enter the hash only when not parquet, so the hash of every Parquet job stays what
        # it was before the formats existed (its output folders still resume).
        excluded = {"storage_options"} | ({"format"} if self.input.format == "parquet" else set())
        if self.input.schema_column is None:  # keys added later enter the hash only when set
            excluded.add("schema_column")
        sampling = _without_unset_new_keys(self.sampling, "sampling", {"structured"})
        constraint = self.sampling.constraint()
        if constraint is not None:  # its canonical key: a schema file's content (not its path) and its
            sampling["structured"] = constraint.key  # property order, which shapes the grammar
        payload = {
            "model": _without_unset_new_keys(self.model, "model"),
            "input": _without_unset_new_keys(self.input, "input", excluded),
            "sampling": sampling,
            "sampling_columns": dict(sorted(self.sampling_columns.items())),
        }
        if self.task != "generate":
            payload["task"] = self.task
        kv_cache = {key: getattr(self.engine, key) for key in KV_CACHE_HASH_KEYS
                    if getattr(self.engine, key) != getattr(EngineConfig, key)}
        if kv_cache:
            payload["kv_cache"] = kv_cache
        if self.writes_batch_output:  # its parts carry the openai_line column
            payload["output_format"] = self.output.format
        if self.output.parse_json:  # its parts carry the parsed answer's columns
            payload["parse_json"] = True
        if self.metrics:  # its parts carry the verdict columns
            payload["metrics"] = {name: spec.model_dump(exclude={"min"})  # a threshold changes no verdict
                                  for name, spec in sorted(self.metrics.items())}
        if self._upstream_identities:  # a stage: what it reads is the earlier stages' output
            payload["upstream"] = dict(sorted(self._upstream_identities.items()))
            payload["keep_columns"] = [self.output.keep_columns, dict(sorted(self.output.rename_columns.items()))]
        blob = json.dumps(payload, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()


    @property
    def generation_config_record(self) -> dict:
        """What `_SUCCESS` says of model.generation_config: the setting, the file read, the sampling
        defaults it gave this job (the keys the job file did not set)."""
        if self._generation_config is not None:
            return dict(self._generation_config)
        return {"setting": self.model.generation_config, "file": None, "applied": {}}

    def record_generation_config(self, setting: str, file: str | None, applied: dict) -> None:
        self._generation_config = {"setting": setting, "file": file, "applied": dict(applied)}


def _without_unset_new_keys(section: BaseModel, name: str, excluded: set[str] = frozenset()) -> dict:
    """The section's values for the hash, less HASHED_WHEN_SET keys still at their default."""
    values = section.model_dump(exclude=set(excluded))
    for key in HASHED_WHEN_SET.get(name, ()):
        if key in values and values[key] == type(section).model_fields[key].get_default(call_default_factory=True):
            del values[key]
    return values


def max_tokens_rule(max_tokens: int, max_model_len: int, origin: str = "model.max_model_len") -> str | None:
    """What is wrong with max_tokens against a context length (None: nothing): prompt + completion
    must fit, and a prompt has at least one token."""
    if max_tokens >= max_model_len:
        return f"must be below {origin} ({max_model_len})"
    return None


def _structured_error(exc: StructuredOutputError, values: dict | None) -> InitErrorDetails:
    """sampling.structured.<key>: the constraint's field (a schema file's problems name json_file)."""
    key = exc.field
    if key == "json" and values and structured_job.FILE_KEY in values:
        key = structured_job.FILE_KEY
    loc = ("sampling", "structured", key) if key else ("sampling", "structured")
    return _key_error(loc, exc.reason, None)


def _key_error(loc: tuple[str, ...], rule: str, value: Any) -> InitErrorDetails:
    error = PydanticCustomError("setting", "{rule}", {"rule": rule})
    return InitErrorDetails(type=error, loc=loc, input=value)
