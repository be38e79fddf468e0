"""The job file's sections as pydantic models: `model`, `engine`, `sampling` derived from EngineConfig's
and SamplingParams' fields (job_settings.py says which field sits where), `input`, `batching`, `output`
and `cluster` written here. A field's docstring is its description (`use_attribute_docstrings`; a
derived field takes its dataclass field's docstring), the text of the generated job reference."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, create_model, field_validator, model_validator

from batchgen.config_docs import field_docs
from batchgen.engine.config import EngineConfig
from batchgen.engine.decoding.structured import StructuredOutputsParams
from batchgen.engine.sampling.sampling_params import SamplingParams
from batchgen.engine.text.chat_template import ChatTemplateOptions
from batchgen.pipeline import structured_job
from batchgen.pipeline.batch_file import BATCH_FORMAT, BATCH_ID_COLUMN, BATCH_LINE_COLUMN, is_batch_path
from batchgen.pipeline.job_settings import (
    ENGINE_ONLY,
    JOB_DEFAULTS,
    MODEL_KEYS,
    MODEL_PATH_FIELD,
    ROW_OVERRIDABLE,
    SAMPLING_ONLY,
    SAMPLING_RENAMED,
)
from batchgen.pipeline.prompt_template import template_columns


class Section(BaseModel):
    """A job file section: unknown keys are errors; field docstrings are descriptions."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


def derive_section(name: str, owner: type, section: str, keys: Iterable[str],
                   base: type[BaseModel] = Section) -> type[BaseModel]:
    """A pydantic section whose keys are fields of the dataclass `owner`, with its types, defaults (the
    job's where JOB_DEFAULTS says so) and docstrings. Values are checked by constructing `owner` (see
    JobConfig)."""
    hints = typing.get_type_hints(owner)
    docs = field_docs(owner)
    fields = {f.name: f for f in dataclasses.fields(owner)}
    definitions: dict[str, Any] = {}
    for key in keys:
        if (section, key) in JOB_DEFAULTS:
            default = Field(default=JOB_DEFAULTS[section, key][0], description=docs.get(key))
        elif fields[key].default_factory is not dataclasses.MISSING:
            default = Field(default_factory=fields[key].default_factory, description=docs.get(key))
        else:
            default = Field(default=fields[key].default, description=docs.get(key))
        definitions[key] = (hints[key], default)
    return create_model(name, __base__=base, **definitions)


def engine_keys(owner: type = EngineConfig) -> list[str]:
    """EngineConfig fields under `engine:`: all but model.path, the model keys and the engine-only ones."""
    return [f.name for f in dataclasses.fields(owner)
            if f.name not in (MODEL_PATH_FIELD, *MODEL_KEYS, *ENGINE_ONLY)]


def sampling_keys(owner: type = SamplingParams) -> list[str]:
    """SamplingParams fields under `sampling:` by their own name: all but the engine-only and renamed ones."""
    renamed = {field for field, _ in SAMPLING_RENAMED.values()}
    return [f.name for f in dataclasses.fields(owner) if f.name not in SAMPLING_ONLY and f.name not in renamed]


class _ModelPath(Section):
    path: str = Field(min_length=1)
    """The model: a bundled alias, a Hugging Face folder, a `.gguf` file, a Hugging Face repo id (org/name)
    or an fsspec URI; relative to the job file's folder."""
    lora_modules: dict[str, str] = Field(default_factory=dict)
    """LoRA adapters over the model, by name: {name: PEFT folder (relative to the job file's folder) or
    Hugging Face repo id}. One adapter without input.lora_column runs every row, merged into the weights
    at load (base speed); several, or one with input.lora_column, turn engine.enable_lora on and need
    input.lora_column (in an OpenAI batch file, each line's `model` names its adapter)."""


ModelSection = derive_section("ModelSection", EngineConfig, "model", MODEL_KEYS, base=_ModelPath)
EngineSection = derive_section("EngineSection", EngineConfig, "engine", engine_keys())


class _SamplingBase(Section):
    """The sampling keys that are not SamplingParams fields of the same name (SAMPLING_RENAMED)."""

    structured: dict[str, Any] | None = None
    """One structured-output constraint for every row: one of json (an inline schema), json_file (a
    schema file, relative to the job file), regex, choice, grammar, json_object; plus
    disable_any_whitespace. Builds SamplingParams.structured_outputs."""
    _schema_file: dict | None = PrivateAttr(default=None)  # structured.json_file's content, once read

    @field_validator("structured")
    @classmethod
    def _check_structured_keys(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        problem = structured_job.check_keys(value or {})
        if problem:
            raise ValueError(f"{problem[0]}: {problem[1]}")
        return value

    def constraint(self) -> StructuredOutputsParams | None:
        """The job's structured-output constraint (None: none, or json_file not read yet)."""
        return structured_job.job_constraint(self.structured, self._schema_file)


SamplingSection = derive_section("SamplingSection", SamplingParams, "sampling", sampling_keys(), base=_SamplingBase)

# sampling_columns: key -> the kind of column it needs (schema.py checks input columns against it).
_KINDS = {float: "float", int: "int", bool: "bool"}
_SAMPLING_TYPES = typing.get_type_hints(SamplingParams)
OVERRIDABLE_SAMPLING_KEYS = {key: _KINDS[_SAMPLING_TYPES[key]] for key in ROW_OVERRIDABLE}


InputFormat = Literal["auto", "parquet", "openai_batch"]
# input.* keys that mean nothing for an OpenAI batch file (each line's body holds its prompt and
# settings), with the one value they may hold there: any other value is refused rather than ignored.
# (Those values are what a batch job's own section holds, so a dumped job validates again.)
_BATCH_FILE_VALUES = {"id_column": BATCH_ID_COLUMN, "prompt_column": None, "messages_column": None,
                      "system_prompt": None, "apply_chat_template": True, "schema_column": None,
                      "prompt_template": None, "tools_column": None, "tools": None, "tool_choice": None,
                      "parallel_tool_calls": True, "lora_column": None}


class InputSection(Section):
    """The rows to run: Parquet files (one row per request) or OpenAI batch files."""

    path: str = Field(min_length=1)
    """A file, a folder, a glob or a URI (s3://, gs://, memory://, ...), relative to the job file's folder."""
    format: InputFormat = "auto"
    """auto | parquet | openai_batch (JSONL lines {custom_id, method, url, body}). auto: openai_batch for
    a path ending in .jsonl, else parquet."""
    id_column: str = "id"
    """The column naming each row (its output rows carry it as `id`)."""
    prompt_column: str | None = "prompt"
    """The column of raw text prompts (or set messages_column)."""
    messages_column: str | None = None
    """The column of chat messages (a list of {role, content}), in place of prompt_column."""
    continuations_column: str | None = None
    """task: loglikelihood: the continuations to score after each row's prompt (a list of strings per row)."""
    continuation_column: str | None = None
    """task: loglikelihood: one continuation to score per row (a string), in place of continuations_column."""
    apply_chat_template: bool = True
    """Raw prompts go through the model's chat template as a user message (false: sent as is)."""
    system_prompt: str | None = None
    """A system message put before every row's messages."""
    on_overlong: Literal["error", "truncate_left"] = "error"
    """error | truncate_left: a prompt too long for max_model_len - max_tokens is an error row, or keeps
    its last tokens."""
    rows_per_unit: int = Field(default=10000, ge=1)
    """Input rows per work unit; one output file per unit."""
    allow_duplicate_ids: bool = False
    """false: repeated ids make the job bad; true: they are separate requests (each its own samples)."""
    storage_options: dict[str, Any] = Field(default_factory=dict)
    """fsspec options for the input's filesystem (credentials, endpoint); not in the config hash."""
    allow_special_tokens: bool = False
    """false: control-token text in prompts and messages is encoded as text, not as the control token."""
    max_prompt_bytes: int | None = Field(default=None, ge=1)
    """A row whose prompt text is longer becomes an error row; null: max(1 MiB, 16 x max_model_len)."""
    chat_template: str | None = None
    """The chat template in place of the model's: a Jinja file (relative to the job file) or the
    template's text; validate_job reads a file into its text."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra variables for the chat template (e.g. enable_thinking)."""
    schema_column: str | None = None
    """A JSON schema per row (its JSON text) constraining that row's output; null cells:
    sampling.structured."""
    prompt_template: str | None = None
    """A Jinja template (sandboxed) rendering each row's prompt from its columns, in place of prompt_column
    and messages_column, e.g. an LLM judge's `Rate this answer: {{ completion }}` (distilabel's
    TextGeneration `template`); the rendered text is the user message (or, with apply_chat_template
    false, the raw prompt)."""
    tools_column: str | None = None
    """Tools per row: OpenAI's tools list as JSON text, rendered through the chat template; the output
    gets a tool_calls column (pipeline/tool_rows.py). Null cells: input.tools."""
    tools: list[dict[str, Any]] | None = None
    """OpenAI's tools list for every row (a row's tools_column cell wins)."""
    tool_choice: str | dict[str, Any] | None = None
    """none | auto | required | {type: function, function: {name}}; null: auto when model.tool_call_parser
    is set, else the tools are only shown to the model. required and a named function are forced."""
    parallel_tool_calls: bool = True
    """OpenAI's parallel_tool_calls for the rows with tools: false, a forced (required) output is one
    call, then the sample ends."""
    lora_column: str | None = None
    """The LoRA adapter of each row: a name in model.lora_modules, or null for the base model. Rows of
    different adapters and of the base run in the same engine steps."""
    completion_column: str | None = None
    """task: reward: the column of completions scored after each row's prompt (a string per row); null:
    `completion` (a generate job's output column)."""

    @field_validator("prompt_template")
    @classmethod
    def _check_prompt_template(cls, value: str | None) -> str | None:
        if value is not None:
            template_columns(value)  # a ValueError saying what does not parse
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _check_template_kwargs(cls, value: dict[str, Any]) -> dict[str, Any]:
        ChatTemplateOptions(chat_template_kwargs=value)  # names a key that would clash with the call
        return value

    @property
    def chat_options(self) -> ChatTemplateOptions:
        """How this job's messages are rendered (a batch line may add its own settings)."""
        return ChatTemplateOptions(self.chat_template, chat_template_kwargs=self.chat_template_kwargs)

    @model_validator(mode="after")
    def _one_prompt_source(self) -> InputSection:
        if self.format == "auto":
            self.format = BATCH_FORMAT if is_batch_path(self.path) else "parquet"
        if self.format == BATCH_FORMAT:
            return self._as_batch_file()
        if self.prompt_template is not None:
            if self.messages_column is not None or ("prompt_column" in self.model_fields_set
                                                    and self.prompt_column is not None):
                raise ValueError("set prompt_template, prompt_column or messages_column: one prompt source")
            self.prompt_column = None
        elif self.messages_column is not None:
            if "prompt_column" in self.model_fields_set and self.prompt_column is not None:
                raise ValueError("set prompt_column or messages_column, not both")
            self.prompt_column = None
            if not self.apply_chat_template:
                raise ValueError("messages_column needs apply_chat_template: true (messages go through the template)")
        elif self.prompt_column is None:
            raise ValueError("set prompt_column (raw text) or messages_column (chat messages)")
        if self.system_prompt is not None and not self.apply_chat_template:
            raise ValueError("system_prompt needs apply_chat_template: true")
        if (self.chat_template is not None or self.chat_template_kwargs) and not self.apply_chat_template:
            raise ValueError("chat_template and chat_template_kwargs need apply_chat_template: true")
        return self

    def _as_batch_file(self) -> InputSection:
        given = [key for key, value in _BATCH_FILE_VALUES.items()
                 if key in self.model_fields_set and getattr(self, key) != value]
        if given:
            raise ValueError(f"format openai_batch takes no {', '.join(given)} (each line's custom_id is its "
                             "id, its url and body say how to prompt); remove them")
        if self.allow_duplicate_ids:
            raise ValueError("allow_duplicate_ids must be false with format openai_batch: a custom_id names "
                             "one line of output.jsonl, as in OpenAI's Batch API")
        self.id_column, self.prompt_column, self.messages_column = BATCH_ID_COLUMN, None, None
        return self

    @property
    def is_batch_file(self) -> bool:
        return self.format == BATCH_FORMAT

    @property
    def scored_column(self) -> str | None:
        """The column of continuations to score (task: loglikelihood), whichever kind it is."""
        return self.continuations_column or self.continuation_column

    @property
    def prompt_source_columns(self) -> list[str]:
        """The columns a row's prompt is made from: the template's variables, else the text column."""
        if self.prompt_template is not None:
            return template_columns(self.prompt_template)
        return [self.text_column]

    @property
    def text_column(self) -> str:
        """The column holding the prompt, whichever kind it is (a batch file's whole line)."""
        if self.is_batch_file:
            return BATCH_LINE_COLUMN
        return self.messages_column or self.prompt_column


class BatchingSection(Section):
    """How requests are ordered before they reach the engine."""

    sort_by_length: bool = True
    """Within a window, order requests by shared prefix, then length (outputs do not change)."""
    window: int = Field(default=8192, ge=1)
    """Requests read ahead and ordered together."""


class OutputSection(Section):
    """Where and how the results are written."""

    path: str = ""
    """The output folder or URI, relative to the job file's folder; empty: out/<name>/ beside the job file."""
    format: InputFormat = "auto"
    """auto | parquet | openai_batch. auto: openai_batch when the input is a batch file, else parquet.
    openai_batch also writes output.jsonl and errors.jsonl (OpenAI's Batch API output) before _SUCCESS."""
    keep_columns: list[str] = Field(default_factory=list)
    """Input columns copied to every output row."""
    parse_json: bool = False
    """true: each completion, a JSON object (sampling.structured's json or json_file schema), is parsed
    into one column per top-level property of the schema (an LLM judge's `score`, `reason`); a completion
    that does not parse gives nulls."""
    rename_columns: dict[str, str] = Field(default_factory=dict)
    """Kept input columns written under another name: {input column: output column}. A stage that reads
    an earlier stage keeps the columns of it that it writes itself (a judge's `completion`) as
    `<earlier stage>_<column>` this way."""
    storage_options: dict[str, Any] = Field(default_factory=dict)
    """fsspec options for the output's filesystem (credentials, endpoint); not in the config hash."""
    checkpoint_seconds: float = Field(default=10.0, gt=0)
    """Seconds between checkpoints: finished rows are written to `_checkpoints/` at least this often, so a
    crash or kill -9 loses at most this much finished work (a rerun reuses the rest); a unit's part replaces
    its rows there. Not in the config hash."""


class ClusterSection(Section):
    """Where the job runs: this process (local) or engine replicas on Ray. Not in the config hash:
    a row's output does not depend on where it ran."""

    backend: Literal["local", "ray"] = "local"
    """local (this process) | ray (one engine replica per GPU on a Ray cluster)."""
    address: str | None = None
    """Ray's address: null starts a local cluster (or joins RAY_ADDRESS); auto or ray://... joins one."""
    replicas: int | Literal["auto"] = "auto"
    """Engine replicas; auto: one per GPU in the cluster, one on a CPU-only cluster."""
    gpus_per_replica: float = Field(default=1, ge=0)
    """GPUs each replica reserves."""
    cpus_per_replica: float | None = Field(default=None, ge=0)
    """CPUs each replica reserves; null: Ray's default for an actor."""

    @field_validator("replicas")
    @classmethod
    def _positive_replicas(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError("must be auto or >= 1")
        return value
