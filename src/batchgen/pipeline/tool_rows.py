"""Tools in jobs: a row's tools (input.tools_column, JSON text) or the job's (input.tools), its
tool_choice (input.tool_choice), rendered through the chat template and forced or parsed with
model.tool_call_parser (engine/text/tools.py holds the rules; this file applies them to rows).

A row's output then has `tool_calls` (OpenAI's list as JSON text; null when the sample made none)
and finish_reason `tool_calls` where the sample ended with calls; `completion` holds the text
outside them.
"""

from __future__ import annotations

import dataclasses
import json

from batchgen.engine.text.chat_template import ChatTemplateOptions
from batchgen.engine.text.tool_parsers import ToolParser, get_tool_parser
from batchgen.engine.text.tools import (
    ToolRequest,
    ToolsError,
    check_tool_choice,
    check_tools,
    forced_constraint,
)


def job_has_tools(job) -> bool:
    """Whether the job's rows may carry tools (and its output a tool_calls column)."""
    inp = job.input
    return inp.tools_column is not None or inp.tools is not None or (
        inp.is_batch_file and job.model.tool_call_parser is not None)


def check_job_tools(job) -> list[tuple[tuple[str, ...], str, object]]:
    """(key, rule, value) for each bad tools (or thinking budget) setting of a job: checked before any
    generation."""
    inp = job.input
    problems = []
    tools = None
    if inp.tools is not None:
        try:
            tools = check_tools(inp.tools, "input.tools")
        except ToolsError as exc:
            problems.append((("input", "tools"), exc.reason if exc.field == "input.tools" else str(exc), inp.tools))
            return problems
    has_tools = tools is not None or inp.tools_column is not None
    if inp.tool_choice is not None and not has_tools:
        problems.append((("input", "tool_choice"), "needs input.tools or input.tools_column", inp.tool_choice))
    elif tools is not None:
        try:
            check_tool_choice(inp.tool_choice, tools)
        except ToolsError as exc:
            problems.append((("input", "tool_choice"), str(exc), inp.tool_choice))
    if inp.tool_choice == "auto" and job.model.tool_call_parser is None:
        problems.append((("input", "tool_choice"), "auto needs model.tool_call_parser (the format calls are read "
                         "in)", inp.tool_choice))
    if job.sampling.thinking_token_budget is not None and job.model.reasoning_parser is None:
        problems.append((("sampling", "thinking_token_budget"), "needs model.reasoning_parser (the markers the "
                         "budget ends the thinking with)", job.sampling.thinking_token_budget))
    if has_tools and not inp.apply_chat_template:
        problems.append((("input", "apply_chat_template"), "must be true with tools (they are rendered through "
                         "the chat template)", False))
    return problems


def row_tool_request(job, raw_tools: str | None) -> ToolRequest | None:
    """A row's ToolRequest: its tools column's JSON (else the job's tools) with the job's tool_choice.
    ValueError naming the column for a bad value."""
    inp = job.input
    where = f"column {inp.tools_column!r}" if raw_tools is not None else "input.tools"
    if raw_tools is not None:
        try:
            tools_value = json.loads(raw_tools)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the row's tools ({where}) are not JSON: {exc}") from None
    else:
        tools_value = inp.tools
    if tools_value is None:
        return None
    try:
        tools = check_tools(tools_value)
        request = check_tool_choice(inp.tool_choice, tools, inp.parallel_tool_calls)
    except ToolsError as exc:
        raise ValueError(f"the row's tools ({where}): {exc}") from None
    if request is not None and request.choice == "auto" and job.model.tool_call_parser is None:
        request = ToolRequest(request.tools, "none")  # tools shown to the model, calls not read
    return request


def tool_parser_of(job) -> ToolParser:
    """The job's tool-call parser (forced calls without one are written and read in hermes' format)."""
    return get_tool_parser(job.model.tool_call_parser or "hermes")


def apply_tools(request: ToolRequest, parser: ToolParser, params, chat: ChatTemplateOptions):
    """(params, chat) for a row with tools: the tools in the template; forced calls as the constraint
    (ValueError when the row is constrained otherwise too); special tokens kept where the format's
    marker is one."""
    chat = dataclasses.replace(chat, tools=request.tools)
    constraint = forced_constraint(parser, request)
    changes = {}
    if constraint is not None:
        if params.structured_outputs is not None:
            raise ValueError("tool_choice forces tool calls, and the row is constrained by a schema too")
        changes["structured_outputs"] = constraint
    if request.is_parsed and parser.keeps_special_tokens:
        changes["skip_special_tokens"] = False
    return (dataclasses.replace(params, **changes) if changes else params), chat
