"""Parquet input: decode one input row (binary text columns, per-row sampling values) into what a request needs.

Every problem with a row's own values is a RowError: the row becomes error rows, the job goes on.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from batchgen.pipeline.config import JobConfig
from batchgen.pipeline.prompt_template import render_prompt, template_columns
from batchgen.pipeline.reader import binary_type
from batchgen.pipeline.request_builder import RowError, RowInput
from batchgen.pipeline.reward_job import completion_column
from batchgen.pipeline.tool_rows import row_tool_request


def decode_batch(batch: pa.RecordBatch, job: JobConfig) -> list[RowInput]:
    """The rows of a batch read by `reader.read_rows`, in order."""
    inp = job.input
    ids = _as_python(batch.column(inp.id_column))
    texts = (_rendered(batch, inp.prompt_template) if inp.prompt_template is not None
             else _as_python(batch.column(inp.text_column)))
    scored = _as_python(batch.column(inp.scored_column)) if inp.scored_column is not None else None
    completions = _as_python(batch.column(completion_column(job))) if job.is_reward else None
    overrides = {key: batch.column(name).to_pylist() for key, name in job.sampling_columns.items()}
    schemas = _as_python(batch.column(inp.schema_column)) if inp.schema_column else [None] * batch.num_rows
    tools = _as_python(batch.column(inp.tools_column)) if inp.tools_column else [None] * batch.num_rows
    adapters = _as_python(batch.column(inp.lora_column)) if inp.lora_column else [None] * batch.num_rows
    rows = []
    for i, (raw_id, raw_text, raw_schema) in enumerate(zip(ids, texts, schemas)):
        row_overrides = {key: values[i] for key, values in overrides.items() if values[i] is not None}
        try:
            request_id = _decode_id(raw_id)
        except RowError as exc:
            rows.append(RowInput(None, error=str(exc)))
            continue
        try:
            if isinstance(raw_text, RowError):  # a template this row's columns could not fill
                raise raw_text
            if inp.messages_column is not None:
                prompt = _with_system(_decode_messages(raw_text), inp.system_prompt)
            else:
                prompt = _decode_text(raw_text, "prompt")
                if inp.apply_chat_template:
                    prompt = _with_system([{"role": "user", "content": prompt}], inp.system_prompt)
            schema = None if raw_schema is None else _decode_text(raw_schema, f"the schema ({inp.schema_column})")
            row = RowInput(request_id, prompt, row_overrides, num_prompt_bytes=_num_bytes(raw_text), schema=schema)
            if tools[i] is not None or inp.tools is not None:
                raw_tools = None if tools[i] is None else _decode_text(tools[i], f"the tools ({inp.tools_column})")
                try:
                    row.tools = row_tool_request(job, raw_tools)
                except ValueError as exc:
                    raise RowError(str(exc)) from None
            if adapters[i] is not None:  # null: the base model
                row.lora_name = _decode_text(adapters[i], f"the LoRA adapter ({inp.lora_column})")
            if scored is not None:
                row.continuations = _decode_continuations(scored[i], inp.continuations_column is not None)
                row.num_prompt_bytes += sum(len(c.encode()) for c in row.continuations)
            if completions is not None:
                row.completion = _decode_text(completions[i], "completion", allow_empty=True)
                row.num_prompt_bytes += len(completions[i])
            rows.append(row)
        except RowError as exc:
            rows.append(RowInput(request_id, error=str(exc)))
    return rows


def _rendered(batch: pa.RecordBatch, template: str) -> list[bytes | RowError]:
    """input.prompt_template rendered for each row from its columns (text decoded row by row): the
    prompt's UTF-8 bytes, or the RowError of a row it cannot be rendered for."""
    names = template_columns(template)
    columns = {name: _as_python(batch.column(name)) for name in names}
    rendered: list[bytes | RowError] = []
    for i in range(batch.num_rows):
        try:
            values = {name: _decoded(columns[name][i], name) for name in names}
            rendered.append(render_prompt(template, values).encode())
        except (RowError, ValueError) as exc:
            rendered.append(RowError(str(exc)))
    return rendered


def _decoded(value: Any, name: str) -> Any:
    """A column value with its text decoded (bytes -> str), inside lists and structs too; a null value
    is the row's error (a failed earlier sample has nothing to judge)."""
    if value is None:
        raise RowError(f"input.prompt_template: column {name} is null in this row")
    return _decoded_inner(value, name)


def _decoded_inner(value: Any, name: str) -> Any:
    if isinstance(value, bytes):
        return _decode_text(value, f"column {name}", allow_empty=True)
    if isinstance(value, list):
        return [_decoded_inner(v, name) for v in value]
    if isinstance(value, dict):
        return {k: _decoded_inner(v, name) for k, v in value.items()}
    return value


def _as_python(column: pa.Array) -> list:
    """Python values with every string left as bytes: pyarrow would raise for the whole column otherwise."""
    return column.cast(binary_type(column.type)).to_pylist()


def _num_bytes(value: bytes | list[dict]) -> int:
    if isinstance(value, bytes):
        return len(value)
    return sum(len(message.get("role") or b"") + len(message.get("content") or b"") for message in value)


def _decode_id(value: Any) -> str:
    if value is None:
        raise RowError("id is null")
    if isinstance(value, bytes):
        return _decode_text(value, "id", allow_empty=True)
    return str(value)


def _decode_text(value: bytes | None, what: str, allow_empty: bool = False) -> str:
    if value is None:
        raise RowError(f"{what} is null")
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RowError(f"{what} is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    if not allow_empty and not text.strip():
        raise RowError(f"{what} is empty")
    return text


def _decode_continuations(value: list[bytes] | bytes | None, is_list: bool) -> list[str]:
    """A row's continuations to score: every one a non-empty string (a list must hold at least one)."""
    if not is_list:
        return [_decode_text(value, "continuation", allow_empty=True) or _empty("continuation")]
    if value is None:
        raise RowError("continuations is null")
    if not value:
        raise RowError("continuations is empty: give at least one continuation to score")
    return [_decode_text(c, f"continuations[{i}]", allow_empty=True) or _empty(f"continuations[{i}]")
            for i, c in enumerate(value)]


def _empty(what: str) -> str:
    raise RowError(f"{what} is empty: there is nothing to score")


def _decode_messages(value: list[dict] | None) -> list[dict]:
    if value is None:
        raise RowError("messages is null")
    if not value:
        raise RowError("messages is empty")
    messages = []
    for i, message in enumerate(value):
        if message is None:
            raise RowError(f"messages[{i}] is null")
        role = _decode_text(message.get("role"), f"messages[{i}].role")
        content = _decode_text(message.get("content"), f"messages[{i}].content", allow_empty=True)
        messages.append({"role": role, "content": content})
    return messages


def _with_system(messages: list[dict], system_prompt: str | None) -> list[dict]:
    # A row's own system message wins over the job's system_prompt.
    if system_prompt is None or messages[0]["role"] == "system":
        return messages
    return [{"role": "system", "content": system_prompt}, *messages]
