"""OpenAI Batch API output (output.format openai_batch): one JSON line per request, then the two files.

A finished request's line is made when its output arrives (the tokenizer is at hand for logprob
tokens) and stored in its part's `openai_line` column, on the request's sample 0 row. When every unit
is committed, the process that writes `_SUCCESS` assembles `output.jsonl` (requests that ran) and
`errors.jsonl` (requests that could not) from the committed parts, in unit and row order, each file
written atomically, before `_SUCCESS`. So the files hold exactly the parts' requests, each once, also
after a kill and a resume; and nothing but the parts is needed to assemble them again.

Line shape, as OpenAI's batch output: `{"id", "custom_id", "response": {"status_code", "request_id",
"body"}, "error": null}` with a ChatCompletion or Completion object (usage included) as the body of a
200, and `{"error": {"message", "type", "param", "code"}}` as the body of a 400.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator

import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchgen.engine import RequestOutput
from batchgen.engine.text.tools import parse_tool_output
from batchgen.openai.api_error import APIError
from batchgen.openai.batch_format import output_line
from batchgen.pipeline.config import JobConfig
from batchgen.pipeline.request_builder import RowTask
from batchgen.pipeline.storage import Storage

OUTPUT_JSONL = "output.jsonl"  # the Batch API's output file: one line per request that ran
ERRORS_JSONL = "errors.jsonl"  # and its error file: one line per request that could not

LINE_COLUMN = "openai_line"


class OpenAILines:
    """Makes each request's output line. `tokenizer`: the engine's (token texts for logprobs)."""

    def __init__(self, job: JobConfig, config_hash: str, tokenizer):
        self.model = job.model.path  # the model that ran (a line's own `model` names only an adapter)
        self.config_hash = config_hash
        self.tokenizer = tokenizer
        # A Parquet row is a chat request when it went through the chat template.
        chat = job.input.messages_column is not None or job.input.apply_chat_template
        self.default_endpoint = "chat" if chat else "completions"

    def success(self, task: RowTask, out: RequestOutput) -> str:
        endpoint = task.openai.endpoint if task.openai is not None else self.default_endpoint
        ids = self._ids(task.request_id)
        choices = [self._chat_choice(c, task.tool_parser) if endpoint == "chat" else self._completion_choice(c)
                   for c in sorted(out.outputs, key=lambda c: c.index)]
        num_prompt = len(out.prompt_token_ids)
        num_completion = sum(len(c.token_ids) for c in out.outputs)
        body = {
            "id": ("chatcmpl-" if endpoint == "chat" else "cmpl-") + ids["body"],
            "object": "chat.completion" if endpoint == "chat" else "text_completion",
            "created": int(time.time()),
            "model": task.lora_name or self.model,  # the adapter that ran, as the server names it
            "choices": choices,
            "usage": {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
                      "total_tokens": num_prompt + num_completion,
                      "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}},
        }
        return self._line(task.request_id, ids, 200, body)

    def error(self, task: RowTask) -> str:
        info = task.openai
        error = APIError(400, task.error, info.error_param if info is not None else None,
                         info.error_code if info is not None else None)
        return self._line(task.request_id, self._ids(task.request_id), error.status, error.body)

    def _ids(self, custom_id: str | None) -> dict[str, str]:
        # Stable across runs: a resumed job's lines name requests as the first run's would.
        digest = hashlib.sha256(f"{self.config_hash}\x00{custom_id}".encode()).hexdigest()
        return {"line": digest[:24], "request": digest[24:48], "body": digest[48:64]}

    def _line(self, custom_id: str | None, ids: dict[str, str], status: int, body: dict) -> str:
        return output_line(f"batch_req_{ids['line']}", custom_id, f"req_{ids['request']}", status, body)

    def _chat_choice(self, c, tool_parser=None) -> dict:
        logprobs = None
        if c.logprobs is not None:
            texts = self.tokenizer.token_texts(c.token_ids)
            content = []
            for j, (token, logprob) in enumerate(zip(texts, c.logprobs)):
                top = [] if c.top_logprobs is None else [
                    {"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode())}
                    for t in c.top_logprobs[j]]
                content.append({"token": token, "logprob": logprob, "bytes": list(token.encode()),
                                "top_logprobs": top})
            logprobs = {"content": content, "refusal": None}
        message = {"role": "assistant", "content": c.content if c.content is not None else c.text, "refusal": None}
        if c.reasoning_content is not None:
            message["reasoning_content"] = c.reasoning_content
        finish_reason = c.finish_reason
        if tool_parser is not None:
            content, calls, finish_reason = parse_tool_output(tool_parser, message["content"], finish_reason)
            if calls:
                message["content"] = content or None
                message["tool_calls"] = [call.to_openai() for call in calls]
        return {"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}

    def _completion_choice(self, c) -> dict:
        logprobs = None
        if c.logprobs is not None:
            texts = self.tokenizer.token_texts(c.token_ids)
            offsets, offset = [], 0
            for token in texts:
                offsets.append(offset)
                offset += len(token)
            # Each position's most likely tokens, the chosen one always among them (as vLLM answers).
            top = []
            for j, (token, logprob) in enumerate(zip(texts, c.logprobs)):
                most_likely = c.top_logprobs[j] if c.top_logprobs else []
                top.append({token: logprob, **{t.token: t.logprob for t in most_likely}})
            logprobs = {"tokens": texts, "token_logprobs": list(c.logprobs), "top_logprobs": top,
                        "text_offset": offsets}
        return {"index": c.index, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish_reason}


def iter_part_lines(storage: Storage, part_names: list[str], errors: bool) -> Iterator[str]:
    """The stored lines of the parts, in order: of failed requests (errors) or of the others."""
    for name in part_names:
        with storage.fs.open(storage.join(name), "rb") as f:
            table = pq.read_table(f, columns=["sample_index", "finish_reason", LINE_COLUMN])
        first = table.filter(pc.equal(table["sample_index"], 0))
        is_error = pc.fill_null(pc.equal(first["finish_reason"], "error"), False)
        picked = first.filter(is_error if errors else pc.invert(is_error))
        for line in picked[LINE_COLUMN].to_pylist():
            if line is None:
                raise RuntimeError(f"{name} has a request without its {LINE_COLUMN} (written by another "
                                   "output.format?)")
            yield line


def write_batch_outputs(storage: Storage, part_names: list[str]) -> tuple[int, int]:
    """Write output.jsonl and errors.jsonl from the committed parts (each atomically); their line counts."""
    return (_write_lines(storage, OUTPUT_JSONL, iter_part_lines(storage, part_names, errors=False)),
            _write_lines(storage, ERRORS_JSONL, iter_part_lines(storage, part_names, errors=True)))


def _write_lines(storage: Storage, name: str, lines: Iterator[str]) -> int:
    count = 0

    def write(target) -> None:
        nonlocal count
        f = open(target, "wb") if isinstance(target, str) else None  # a local temp path, or a sink
        try:
            for line in lines:
                (f or target).write(line.encode() + b"\n")
                count += 1
        finally:
            if f is not None:
                f.close()

    storage.write_atomic(name, write)
    return count
