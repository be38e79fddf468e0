"""Input and output schemas: what a job's columns must look like, and the rows it writes (the README's
Output section)."""

from __future__ import annotations

import pyarrow as pa

from batchgen.engine.sampling.sampling_params import as_num_logprobs
from batchgen.metrics import metric_column
from batchgen.pipeline.config import OVERRIDABLE_SAMPLING_KEYS, JobConfig
from batchgen.pipeline.errors import JobError
from batchgen.pipeline.input_file import InputFile

TOP_LOGPROB = pa.struct([("token_id", pa.int32()), ("token", pa.string()), ("logprob", pa.float32())])
# Output columns in order; `token_logprobs` only when sampling.logprobs is on, `top_logprobs` only when
# it is a number N > 0; kept columns follow.
GENERATED_FIELDS = [
    pa.field("sample_index", pa.int32()),
    pa.field("completion", pa.string()),
    # model.reasoning_parser: the thinking (completion is then the answer) and its tokens
    pa.field("reasoning", pa.string()),
    pa.field("reasoning_tokens", pa.int64()),
    # tools (pipeline/tool_rows.py): OpenAI's tool_calls list as JSON text, null without calls
    pa.field("tool_calls", pa.string()),
    pa.field("completion_token_ids", pa.list_(pa.int32())),
    pa.field("finish_reason", pa.string()),
    pa.field("prompt_tokens", pa.int64()),
    pa.field("cached_tokens", pa.int64()),
    pa.field("completion_tokens", pa.int64()),
    pa.field("cumulative_logprob", pa.float64()),
    pa.field("token_logprobs", pa.list_(pa.float32())),
    pa.field("top_logprobs", pa.list_(pa.list_(TOP_LOGPROB))),
    pa.field("queue_s", pa.float64()),
    pa.field("ttft_s", pa.float64()),
    pa.field("tpot_s", pa.float64()),
    pa.field("e2e_s", pa.float64()),
    pa.field("num_accepted_tokens", pa.int64()),  # speculative decoding's accepted drafts; null when off
    pa.field("error", pa.string()),
    # output.format openai_batch: the request's line of output.jsonl / errors.jsonl, on its sample 0 row
    # (null on the others). The part carries it so that the .jsonl files are assembled from committed
    # parts alone, and a resumed job's lines are those its parts hold.
    pa.field("openai_line", pa.string()),
]
# task: loglikelihood: one row per input row (its context), one list entry per continuation in the order
# given; `continuation_token_logprobs` only when sampling.logprobs is true. A row that could not be
# scored has finish_reason error, its message in `error` and null lists.
SCORE_FIELDS = [
    pa.field("sample_index", pa.int32()),  # always 0: a context is one request
    pa.field("continuation_logprob", pa.list_(pa.float64())),  # each continuation's summed token logprobs
    pa.field("continuation_num_tokens", pa.list_(pa.int32())),
    pa.field("is_greedy", pa.list_(pa.bool_())),  # every token of the continuation was the most likely one
    pa.field("continuation_token_ids", pa.list_(pa.list_(pa.int32()))),
    pa.field("continuation_token_logprobs", pa.list_(pa.list_(pa.float32()))),
    pa.field("finish_reason", pa.string()),  # stop | error
    pa.field("prompt_tokens", pa.int64()),  # the context's
    pa.field("cached_tokens", pa.int64()),  # context tokens from the prefix cache
    pa.field("completion_tokens", pa.int64()),  # continuation tokens scored (over all continuations)
    pa.field("queue_s", pa.float64()),
    pa.field("e2e_s", pa.float64()),
    pa.field("error", pa.string()),
]
# model.lora_modules: the adapter each row ran with (null: the base model), after the generated columns.
LORA_FIELD = pa.field("lora_name", pa.string())
RESERVED_NAMES = {"id", LORA_FIELD.name} | {f.name for f in GENERATED_FIELDS} | {f.name for f in SCORE_FIELDS}
# task: reward (reward_job.py): one row per input row; `reward` is float32, or a list of float32 per label
# (reward_fields). A row that could not be scored has finish_reason error and a null reward.
REWARD_FIELDS = [
    pa.field("sample_index", pa.int32()),  # the row's occurrence of its id in the input (0 for the first)
    pa.field("reward", pa.float32()),
    pa.field("finish_reason", pa.string()),  # stop | error
    pa.field("prompt_tokens", pa.int64()),  # the tokens the reward model read: prompt and completion
    pa.field("cached_tokens", pa.int64()),  # of those, from the prefix cache
    pa.field("completion_tokens", pa.int64()),  # 0: nothing is generated
    pa.field("queue_s", pa.float64()),
    pa.field("e2e_s", pa.float64()),
    pa.field("error", pa.string()),
]
REWARD_NAMES = {"id"} | {f.name for f in REWARD_FIELDS}  # what a reward job's kept columns may not be named


def reward_fields(reward_type: pa.DataType) -> list[pa.Field]:
    """A reward job's columns, `reward` of the model's type (reward_job.reward_type)."""
    return [pa.field("reward", reward_type) if f.name == "reward" else f for f in REWARD_FIELDS]


def generated_fields(logprobs: int | bool | None, with_openai_line: bool = False, with_reasoning: bool = False,
                     with_tool_calls: bool = False) -> list[pa.Field]:
    """The generated columns for sampling.logprobs (false | true | N, or the engine's None | 0 | N),
    output.format (openai_batch: the openai_line column), a reasoning parser (reasoning,
    reasoning_tokens) and tools (tool_calls)."""
    num = as_num_logprobs(logprobs)
    left_out = {"token_logprobs"} if num is None else set()
    if not with_reasoning:
        left_out |= {"reasoning", "reasoning_tokens"}
    if not with_tool_calls:
        left_out.add("tool_calls")
    if not num:
        left_out.add("top_logprobs")
    if not with_openai_line:
        left_out.add("openai_line")
    return [f for f in GENERATED_FIELDS if f.name not in left_out]


def score_fields(logprobs: int | bool | None) -> list[pa.Field]:
    """The columns of a loglikelihood job's rows (`continuation_token_logprobs` with sampling.logprobs)."""
    return [f for f in SCORE_FIELDS
            if f.name != "continuation_token_logprobs" or as_num_logprobs(logprobs) is not None]


def output_schema(id_field: pa.Field, keep_fields: list[pa.Field], with_logprobs: int | bool | None,
                  with_openai_line: bool = False, is_scoring: bool = False,
                  metric_fields: list[pa.Field] = (), with_reasoning: bool = False,
                  with_tool_calls: bool = False, reward_type: pa.DataType | None = None,
                  with_lora: bool = False) -> pa.Schema:
    """id (the input's type), the generated (or, task: loglikelihood, the score) columns, lora_name (a
    job with adapters), the metrics' verdict columns, then the kept input columns. `reward_type`: task:
    reward's columns, `reward` of that type."""
    fields = score_fields(with_logprobs) if is_scoring else generated_fields(
        with_logprobs, with_openai_line, with_reasoning, with_tool_calls)
    if reward_type is not None:
        fields = reward_fields(reward_type)
    lora = [LORA_FIELD] if with_lora else []
    return pa.schema([pa.field("id", id_field.type), *fields, *lora, *metric_fields, *keep_fields])


def is_text_list(t: pa.DataType) -> bool:
    """list<string> (large_list and large_string as polars writes)."""
    return (pa.types.is_list(t) or pa.types.is_large_list(t)) and is_text(t.value_type)


def is_text(t: pa.DataType) -> bool:
    return (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)
            or pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t))


def is_messages(t: pa.DataType) -> bool:
    """list<struct<role: string, content: string, ...>> (large_list and large_string as polars writes)."""
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)) or not pa.types.is_struct(t.value_type):
        return False
    fields = {f.name: f.type for f in t.value_type}
    return all(name in fields and is_text(fields[name]) for name in ("role", "content"))


def _is_kind(t: pa.DataType, kind: str) -> bool:
    if kind == "bool":
        return pa.types.is_boolean(t)
    if kind == "int":
        return pa.types.is_integer(t)
    return pa.types.is_integer(t) or pa.types.is_floating(t)  # float


_KIND_NAMES = {"bool": "boolean", "int": "integer", "float": "numeric (integer or floating)"}


def check_input_schema(file: InputFile, job: JobConfig) -> None:
    """Fail (JobError naming the file and column) when a column the job needs is missing or mistyped."""
    inp = job.input
    schema = file.schema

    def column(name: str, key: str) -> pa.DataType:
        if name not in schema.names:
            raise JobError(f"input file {file.display}: column {name!r} ({key}) is missing; "
                           f"columns are: {', '.join(schema.names)}")
        return schema.field(name).type

    def wrong(name: str, key: str, t: pa.DataType, expected: str) -> JobError:
        return JobError(f"input file {file.display}: column {name!r} ({key}) has type {t}; expected {expected}")

    t = column(inp.id_column, "input.id_column")
    if not (pa.types.is_integer(t) or is_text(t)):
        raise wrong(inp.id_column, "input.id_column", t, "an integer or string type")
    if inp.prompt_template is not None:
        for name in inp.prompt_source_columns:
            column(name, "input.prompt_template")
    elif inp.messages_column is not None:
        t = column(inp.messages_column, "input.messages_column")
        if not is_messages(t):
            raise wrong(inp.messages_column, "input.messages_column", t,
                        "a list of structs with string fields role and content")
    else:
        t = column(inp.prompt_column, "input.prompt_column")
        if not is_text(t):
            raise wrong(inp.prompt_column, "input.prompt_column", t, "a string type")
    for key, is_right, expected in (("schema_column", is_text, "a string type (a JSON schema per row)"),
                                    ("tools_column", is_text, "a string type (a JSON list of tools per row)"),
                                    ("lora_column", is_text, "a string type (an adapter's name per row)"),
                                    ("continuations_column", is_text_list, "a list of strings"),
                                    ("continuation_column", is_text, "a string type")):
        name = getattr(inp, key)
        if name is not None:
            t = column(name, f"input.{key}")
            if not is_right(t):
                raise wrong(name, f"input.{key}", t, expected)
    if job.is_reward:
        name = job.input.completion_column or "completion"
        t = column(name, "input.completion_column")
        if not is_text(t):
            raise wrong(name, "input.completion_column", t, "a string type")
    for key, name in job.sampling_columns.items():
        t = column(name, f"sampling_columns.{key}")
        kind = OVERRIDABLE_SAMPLING_KEYS[key]
        if not _is_kind(t, kind):
            raise wrong(name, f"sampling_columns.{key}", t, _KIND_NAMES[kind])
    for metric, spec in job.metrics.items():  # before keep_columns, which they joined: name the metric
        for name in spec.input_columns:
            column(name, f"metrics.{metric}")
    for input_name in job.output.keep_columns:
        column(input_name, "output.keep_columns")
        name = job.output.rename_columns.get(input_name, input_name)  # the output's name
        if name in (REWARD_NAMES if job.is_reward else RESERVED_NAMES):
            raise JobError(f"output.keep_columns: {name!r} clashes with an output column of the same name")
        if name in {metric_column(m) for m in job.metrics}:
            raise JobError(f"output.keep_columns: {name!r} clashes with the verdict column of metric "
                           f"{name[len(metric_column('')):]!r}")
