"""From a decoded row to an engine request: per-row SamplingParams, tokens, the overlong rule.

The input formats decode their rows into RowInput (Parquet rows: parquet_rows.py; OpenAI Batch lines:
pipeline/batch_lines.py); everything after that is format-independent."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from batchgen.engine import SamplingParams
from batchgen.engine.decoding.structured import StructuredOutputError
from batchgen.engine.lora.request import LoRARequest
from batchgen.engine.text.chat_template import ChatTemplateOptions
from batchgen.engine.text.tool_parsers import ToolParser
from batchgen.engine.text.tools import ToolRequest
from batchgen.openai.structured_fields import error_param
from batchgen.pipeline.config import JobConfig
from batchgen.pipeline.lora_job import job_adapter, job_lora_requests
from batchgen.pipeline.reward_job import reward_tokens
from batchgen.pipeline.score_tokens import encode_scored
from batchgen.pipeline.structured_job import row_constraint
from batchgen.pipeline.tool_rows import apply_tools, tool_parser_of

OVERLONG = "overlong"  # RowTask.error_kind: the prompt (with max_tokens, or a continuation) exceeds max_model_len
TOO_MANY_BYTES = "too_many_bytes"  # RowTask.error_kind: the prompt's text is over input.max_prompt_bytes


class RowError(ValueError):
    """This row cannot become a request; the message goes into the output's `error` column.

    `param`: the request field at fault, where there is one (a batch line's body field); `kind`: OVERLONG
    for a row too long for the context (what `validate --tokenize` counts), else None."""

    def __init__(self, message: str, param: str | None = None, kind: str | None = None):
        super().__init__(message)
        self.param = param
        self.kind = kind


Prompt = str | list[dict] | list[int]


@dataclass(frozen=True)
class OpenAIRequest:
    """What a row's OpenAI-shaped output needs beyond its SamplingParams (output.format openai_batch)."""

    endpoint: str | None  # "chat" | "completions"; None for a batch line whose url is not one of them
    error_param: str | None = None  # the field an error row's body.error names
    error_code: str | None = None  # its machine-readable kind (the server's codes), where known
    structured_param: str | None = None  # the body field that set the output constraint, if one did


@dataclass
class RowInput:
    """One decoded input row: its request id, its prompt (text or chat messages), its overrides."""

    request_id: str | None
    prompt: Prompt | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    num_prompt_bytes: int = 0  # the row's own text (prompt, or messages' roles and contents) as stored
    params: SamplingParams | None = None  # already built and checked (a batch line's body): used as is
    schema: str | None = None  # the row's JSON schema (input.schema_column): its structured-output constraint
    sample_key: str | None = None  # the engine's sample key when not the request id (a seeded batch line)
    openai: OpenAIRequest | None = None
    chat: ChatTemplateOptions | None = None  # how its messages render, when not as the job says (a batch line)
    continuations: list[str] | None = None  # task: loglikelihood: what to score after the prompt
    tools: ToolRequest | None = None  # its tools and tool_choice (pipeline/tool_rows.py)
    tool_parser: ToolParser | None = None  # a batch line's parser (its body's tools); else the job's
    completion: str | None = None  # task: reward: the completion scored after the prompt
    lora_name: str | None = None  # the row's adapter (input.lora_column); None: the job's adapter, if one


@dataclass
class RowTask:
    """One input row on its way through the pipeline: a request for the engine, or an error."""

    unit_index: int
    offset: int  # row position within its unit: where its output rows go
    request_id: str | None
    params: SamplingParams | None = None
    token_ids: list[int] | None = None
    error: str | None = None
    sample_key: str | None = None  # None: samples are keyed by request_id (see LLMEngine.add_request)
    openai: OpenAIRequest | None = None
    continuation_token_ids: list[list[int]] | None = None  # task: loglikelihood (token_ids: the context)
    tool_parser: ToolParser | None = None  # reads its samples' tool calls (tools with tool_choice not none)
    is_reward: bool = False  # task: reward: token_ids are the prompt and completion a reward model scores
    sample_index: int = 0  # task: reward: the row's occurrence of its id in the input
    lora_name: str | None = None  # the adapter the row asked for (the output's lora_name); None: the base
    lora_request: LoRARequest | None = None  # that adapter, as the engine takes it
    error_kind: str | None = None  # OVERLONG or TOO_MANY_BYTES when the error is one of those, else None

    @property
    def is_scoring(self) -> bool:
        return self.continuation_token_ids is not None

    @property
    def is_error(self) -> bool:
        return self.error is not None

    @property
    def num_prompt_tokens(self) -> int | None:
        return None if self.token_ids is None else len(self.token_ids)


def max_prompt_bytes(job: JobConfig, max_model_len: int) -> int:
    """input.max_prompt_bytes, by default max(1 MiB, 16 bytes per token of max_model_len).

    A token is ~4 bytes of text, so the default refuses no prompt that could fit the context; what it
    refuses is turned into an error row before the tokenizer spends seconds and gigabytes on it.
    """
    if job.input.max_prompt_bytes is not None:
        return job.input.max_prompt_bytes
    return max(1 << 20, 16 * max_model_len)


class RequestBuilder:
    """Turns RowInputs into RowTasks with the job's defaults, the row's overrides and the engine's tokenizer."""

    def __init__(self, job: JobConfig, engine):
        self.job = job
        self.engine = engine
        self.default_params = job.sampling_params()
        self.chat = job.input.chat_options
        self.max_prompt_bytes = max_prompt_bytes(job, engine.max_model_len)
        self.lora_requests = job_lora_requests(job)
        self.job_adapter = job_adapter(job)

    def build(self, row: RowInput, unit_index: int, offset: int) -> RowTask:
        task = RowTask(unit_index, offset, row.request_id, error=row.error, sample_key=row.sample_key,
                       openai=row.openai, lora_name=row.lora_name or self.job_adapter)
        if task.is_error:
            return task
        if task.lora_name is not None:
            task.lora_request = self.lora_requests.get(task.lora_name)
            if task.lora_request is None:
                task.error = (f"LoRA adapter {task.lora_name!r} (column {self.job.input.lora_column!r}) is not in "
                              f"model.lora_modules ({', '.join(self.lora_requests)})")
                return task
        if row.num_prompt_bytes > self.max_prompt_bytes:
            task.error = (f"the prompt is {row.num_prompt_bytes} bytes, over input.max_prompt_bytes "
                          f"({self.max_prompt_bytes}); not tokenized")
            task.error_kind = TOO_MANY_BYTES
            return task
        try:
            if self.job.is_scoring:
                task.token_ids, task.continuation_token_ids = self._encode_scored(row)
                return task
            if self.job.is_reward:
                task.is_reward = True
                task.token_ids = self._encode_reward(row)
                return task
            task.params = self._params(row)
            chat = row.chat or self.chat
            if row.tools is not None:
                task.params, chat = self._with_tools(row, task, chat)
            elif row.tool_parser is not None:  # a batch line's tools: its body's fields set the rest
                task.tool_parser = row.tool_parser
                if row.tool_parser.keeps_special_tokens and task.params.skip_special_tokens:
                    task.params = dataclasses.replace(task.params, skip_special_tokens=False)
            self._compile(task.params, row)
            task.token_ids = self._encode(row, chat)  # kept on an overlong error: its prompt_tokens tell by how much
            task.token_ids = self._fit(task.token_ids, task.params)
        except RowError as exc:
            task.error = str(exc)
            task.error_kind = exc.kind
            if exc.param is not None and task.openai is not None:  # the body field an error line names
                task.openai = dataclasses.replace(task.openai, error_param=exc.param, error_code="invalid_value")
        return task

    def _encode_scored(self, row: RowInput) -> tuple[list[int], list[list[int]]]:
        """The context's and each continuation's token ids (score_tokens.py), fitted to max_model_len."""
        try:
            context, continuations = encode_scored(self.engine.tokenizer, row.prompt, row.continuations,
                                                   self.job.input.allow_special_tokens, row.chat or self.chat)
        except ValueError as exc:
            raise RowError(str(exc)) from None
        except Exception as exc:  # a template or tokenizer failure is this row's problem only
            raise RowError(f"cannot tokenize the context and continuations: {exc}") from None
        longest = max(len(c) for c in continuations)
        max_model_len = self.engine.max_model_len
        if len(context) + longest <= max_model_len:
            return context, continuations
        if self.job.input.on_overlong == "error":
            raise RowError(f"overlong context: {len(context)} context tokens + {longest} continuation tokens > "
                           f"max_model_len {max_model_len} (input.on_overlong: error)", kind=OVERLONG)
        num_keep = max_model_len - longest
        if num_keep < 1:
            raise RowError(f"a continuation of {longest} tokens leaves no room for the context within "
                           f"max_model_len {max_model_len}", kind=OVERLONG)
        return context[-num_keep:], continuations  # truncate_left, as lm-evaluation-harness cuts a context

    def _encode_reward(self, row: RowInput) -> list[int]:
        """The prompt and completion as the reward model reads them (reward_job.py), fitted to max_model_len."""
        try:
            token_ids = reward_tokens(self.engine, row.prompt, row.completion, self.job.input.allow_special_tokens,
                                      row.chat or self.chat)
        except Exception as exc:  # a template or tokenizer failure is this row's problem only
            raise RowError(f"cannot tokenize the prompt and completion: {exc}") from None
        max_model_len = self.engine.max_model_len
        if len(token_ids) <= max_model_len:
            return token_ids
        if self.job.input.on_overlong == "error":
            raise RowError(f"overlong prompt and completion: {len(token_ids)} tokens > max_model_len "
                           f"{max_model_len} (input.on_overlong: error)", kind=OVERLONG)
        return token_ids[-max_model_len:]  # truncate_left: the completion and the end of the prompt stay

    def _params(self, row: RowInput) -> SamplingParams:
        if row.params is not None:
            return row.params
        if row.schema is not None:
            return self._params_with_schema(row)
        if not row.overrides:
            return self.default_params
        try:
            return self.job.sampling_params(**row.overrides)  # the same checks as the job's own values
        except (ValueError, TypeError) as exc:
            columns = ", ".join(f"{self.job.sampling_columns[k]}={v!r}" for k, v in row.overrides.items())
            raise RowError(f"invalid per-row sampling value ({columns}): {exc}") from None

    def _params_with_schema(self, row: RowInput) -> SamplingParams:
        column = self.job.input.schema_column
        try:
            constraint = row_constraint(row.schema, self.job.sampling.structured)
            return self.job.sampling_params(**row.overrides, structured_outputs=constraint)
        except StructuredOutputError as exc:
            raise RowError(f"the row's schema (column {column!r}) cannot be used: {exc.reason}") from None
        except (ValueError, TypeError) as exc:
            raise RowError(f"the row's schema (column {column!r}) with its sampling values: {exc}") from None

    def _compile(self, params: SamplingParams, row: RowInput) -> None:
        """A constrained row's grammar compiled now, while its window is read ahead (cached: the engine's
        add_request finds it there); one that cannot be compiled is this row's error."""
        if params.structured_outputs is None:
            return
        try:
            self.engine.compile_grammar(params.structured_outputs)
        except StructuredOutputError as exc:
            if row.schema is not None:
                raise RowError(f"the row's schema (column {self.job.input.schema_column!r}) cannot be used: "
                               f"{exc.reason}") from None
            if row.openai is not None and row.openai.structured_param is not None:
                param = error_param(row.openai.structured_param, exc)
                raise RowError(f"{param}: {exc.reason}", param) from None
            raise RowError(str(exc)) from None

    def _with_tools(self, row: RowInput, task: RowTask, chat: ChatTemplateOptions):
        """The row's tools in its template, its forced calls as its constraint, its parser on the task."""
        parser = row.tool_parser or tool_parser_of(self.job)
        try:
            params, chat = apply_tools(row.tools, parser, task.params, chat)
        except ValueError as exc:
            raise RowError(str(exc)) from None
        if row.tools.is_parsed:
            task.tool_parser = parser
        return params, chat

    def _encode(self, row: RowInput, chat: ChatTemplateOptions | None = None) -> list[int]:
        try:
            token_ids = self.engine.encode(row.prompt, allow_special_tokens=self.job.input.allow_special_tokens,
                                           chat=chat or row.chat or self.chat)
        except Exception as exc:  # a template or tokenizer failure is this row's problem only
            raise RowError(f"cannot tokenize the prompt: {exc}") from None
        if not token_ids:
            raise RowError("the prompt has no tokens")
        return token_ids

    def _fit(self, token_ids: list[int], params: SamplingParams) -> list[int]:
        """The overlong rule: prompt tokens + max_tokens must fit in max_model_len."""
        max_model_len = self.engine.max_model_len
        if len(token_ids) + params.max_tokens <= max_model_len:
            return token_ids
        if self.job.input.on_overlong == "error":
            raise RowError(f"overlong prompt: {len(token_ids)} prompt tokens + max_tokens {params.max_tokens} "
                           f"> max_model_len {max_model_len} (input.on_overlong: error)", kind=OVERLONG)
        num_keep = max_model_len - params.max_tokens
        if num_keep < 1:
            raise RowError(f"max_tokens {params.max_tokens} leaves no room for the prompt "
                           f"within max_model_len {max_model_len}", kind=OVERLONG)
        return token_ids[-num_keep:]  # truncate_left: the end of a prompt is what the model answers
