"""OpenAI's response bodies: ChatCompletion, Completion, their streamed chunks, usage and logprobs.

Plain dicts in OpenAI's field names (the `openai` package's pydantic types parse them; the tests
check that). A choice's index is prompt_index * n + sample_index, as OpenAI and vLLM number the
choices of a prompt list.
"""

from __future__ import annotations

from batchgen.engine import RequestOutput
from batchgen.engine.text.tool_parsers import ToolCallStream, ToolParser
from batchgen.engine.text.tools import parse_tool_output
from batchgen.serve.engine_loop import PromptEcho, SampleDelta, TokenLogprob, completion_delta


def sample_deltas(output: RequestOutput, token_texts) -> list[SampleDelta]:
    """A finished RequestOutput's samples as whole-sample deltas, for the body builders below.

    `token_texts`: ids -> each token's text decoded alone (Tokenizer.token_texts), for the chosen
    tokens' logprob entries. For callers that hold a RequestOutput (an OpenAI Batch file's writer);
    the server's engine thread builds the same deltas itself.
    """
    return [completion_delta(c, token_texts) for c in output.outputs]


def usage(outputs: list[RequestOutput]) -> dict:
    """Summed over a request's prompts: prompt tokens count once per prompt, completions per sample."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    body = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
    reasoning = [c.num_reasoning_tokens for o in outputs for c in o.outputs if c.num_reasoning_tokens is not None]
    if reasoning:  # a reasoning parser counted the thinking (OpenAI's field)
        body["completion_tokens_details"] = {"reasoning_tokens": sum(reasoning)}
    return body


# A log-probability of -inf (a token a structured-output grammar rules out, listed among the top ones)
# is not JSON: sent as this floor, as vLLM does.
MIN_LOGPROB = -9999.0


def _json_logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def chat_logprobs(tokens: list[TokenLogprob] | None) -> dict | None:
    """{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]} (chat's shape)."""
    if tokens is None:
        return None
    return {"content": [
        {"token": t.token, "logprob": _json_logprob(t.logprob), "bytes": list(t.token.encode()),
         "top_logprobs": [{"token": top.token, "logprob": _json_logprob(top.logprob), "bytes": list(top.token.encode())}
                          for top in t.top]}
        for t in tokens]}


def completion_logprobs(tokens: list[TokenLogprob] | None, text_offset: int = 0,
                        prompt: PromptEcho | None = None) -> dict | None:
    """{"tokens", "token_logprobs", "top_logprobs", "text_offset"} (the legacy shape, as vLLM fills it):
    per token its text, its log-probability and {text: logprob} of the token itself and the top N.

    `text_offset` is where these tokens' text starts in the choice's text (streams send pieces).
    `prompt` (echo): the prompt's tokens first, the first with null log-probability and top_logprobs.
    """
    if tokens is None:
        return None
    texts, values, tops = [], [], []
    if prompt is not None:
        for token, entry in zip(prompt.tokens, prompt.logprobs):
            texts.append(token)
            values.append(None if entry is None else _json_logprob(entry.logprob))
            tops.append(None if entry is None else _top_dict(entry))
    for t in tokens:
        texts.append(t.token)
        values.append(_json_logprob(t.logprob))
        tops.append(_top_dict(t))
    offsets, position = [], text_offset
    for token in texts:
        offsets.append(position)
        position += len(token)
    return {"tokens": texts, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def _top_dict(t: TokenLogprob) -> dict[str, float]:
    """The token itself, then its position's top N (vLLM's and OpenAI's legacy `top_logprobs` entry)."""
    top = {t.token: _json_logprob(t.logprob)}
    for other in t.top:
        top.setdefault(other.token, _json_logprob(other.logprob))
    return top


def prompt_logprobs_body(prompt: PromptEcho | None) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs` field: null for the first token, then {token id: {logprob, rank,
    decoded_token}} per position (the prompt's token first, then the top N)."""
    if prompt is None or prompt.prompt_logprobs is None:
        return None
    return [None if position is None else
            {str(token_id): {"logprob": _json_logprob(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
             for token_id, lp in position.items()}
            for position in prompt.prompt_logprobs]


def chat_message(d: SampleDelta, tool_parser: ToolParser | None = None) -> tuple[dict, str | None]:
    """(a whole sample's assistant message, its finish reason): the answer as content, the thinking as
    reasoning_content (a reasoning parser), the calls as tool_calls (finish reason tool_calls)."""
    content = d.content if d.content is not None else d.text
    message: dict = {"role": "assistant", "content": content}
    if d.reasoning is not None:
        message["reasoning_content"] = d.reasoning
    finish_reason = d.finish_reason
    if tool_parser is not None:
        content, calls, finish_reason = parse_tool_output(tool_parser, content, finish_reason)
        if calls:
            message["content"] = content or None
            message["tool_calls"] = [call.to_openai() for call in calls]
    return message, finish_reason


def chat_completion(response_id: str, created: int, model: str, outputs: list[RequestOutput],
                    deltas: list[list[SampleDelta]], n: int, prompts: list[PromptEcho | None] | None = None,
                    tool_parser: ToolParser | None = None) -> dict:
    """`prompts`: the conversation's PromptEcho when prompt_logprobs was asked (vLLM's top-level field);
    `tool_parser`: reads each sample's tool calls (the request's tools, tool_choice not none)."""
    choices = []
    for p, prompt_deltas in enumerate(deltas):
        for d in prompt_deltas:
            message, finish_reason = chat_message(d, tool_parser)
            choices.append({"index": p * n + d.index, "message": message, "logprobs": chat_logprobs(d.logprobs),
                            "finish_reason": finish_reason, "stop_reason": d.stop_reason})
    body = {"id": response_id, "object": "chat.completion", "created": created, "model": model,
            "choices": sorted(choices, key=lambda c: c["index"]), "usage": usage(outputs)}
    if prompts and prompts[0] is not None:
        body["prompt_logprobs"] = prompt_logprobs_body(prompts[0])
    return body


def completion(response_id: str, created: int, model: str, outputs: list[RequestOutput],
               deltas: list[list[SampleDelta]], n: int, prompts: list[PromptEcho | None] | None = None,
               echo: bool = False, is_echo_only: bool = False) -> dict:
    """`prompts`: each prompt's PromptEcho (echo or prompt_logprobs). With `echo` each choice's text and
    logprobs start with its prompt's; `is_echo_only` (max_tokens 0): they hold the prompt alone."""
    prompts = prompts or [None] * len(deltas)
    choices = []
    for p, (prompt_deltas, prompt) in enumerate(zip(deltas, prompts)):
        for d in prompt_deltas:
            text, tokens = d.text, d.logprobs
            if is_echo_only:
                text, tokens = "", (None if d.logprobs is None else [])
            logprobs = completion_logprobs(tokens, prompt=prompt if echo else None)
            choice = {"index": p * n + d.index, "text": prompt.text + text if echo else text,
                      "logprobs": logprobs, "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}
            if prompt is not None and prompt.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_body(prompt)
            choices.append(choice)
    return {"id": response_id, "object": "text_completion", "created": created, "model": model,
            "choices": sorted(choices, key=lambda c: c["index"]), "usage": usage(outputs)}


class ChunkWriter:
    """The `data: ...` lines of one streamed response (chat or completions)."""

    def __init__(self, is_chat: bool, response_id: str, created: int, model: str, n: int, include_usage: bool,
                 tool_parser: ToolParser | None = None):
        """`tool_parser`: chat's tool calls are read from each choice's answer as it streams."""
        self.is_chat, self.n, self.include_usage = is_chat, n, include_usage
        self.tool_parser = tool_parser
        self.tool_streams: dict[int, ToolCallStream] = {}  # per choice
        self.head = {"id": response_id, "object": "chat.completion.chunk" if is_chat else "text_completion",
                     "created": created, "model": model}
        self.text_offsets: dict[int, int] = {}  # completions' logprobs.text_offset, per choice

    def chunk(self, choices: list[dict], usage_: dict | None = None, with_usage: bool = False) -> dict:
        body = {**self.head, "choices": choices}
        if self.include_usage:  # OpenAI: null on every chunk but the last, which has no choices
            body["usage"] = usage_ if with_usage else None
        return body

    def role_chunk(self, num_prompts: int) -> dict:
        """Chat's first chunk: the assistant role for every choice."""
        return self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None} for i in range(num_prompts * self.n)])

    def delta_chunk(self, prompt_index: int, deltas: list[SampleDelta]) -> dict:
        choices = []
        for d in deltas:
            index = prompt_index * self.n + d.index
            if self.is_chat:
                delta, finish_reason = self._chat_delta(index, d)
                choice = {"index": index, "delta": delta, "logprobs": chat_logprobs(d.logprobs),
                          "finish_reason": finish_reason}
            else:
                offset = self.text_offsets.get(index, 0)
                self.text_offsets[index] = offset + len(d.text)
                choice = {"index": index, "text": d.text, "logprobs": completion_logprobs(d.logprobs, offset),
                          "finish_reason": d.finish_reason}
            if d.finish_reason is not None:
                choice["stop_reason"] = d.stop_reason
            choices.append(choice)
        return self.chunk(choices)

    def _chat_delta(self, index: int, d: SampleDelta) -> tuple[dict, str | None]:
        """A chat choice's delta: reasoning_content, content and tool_calls pieces (OpenAI's stream: a
        call's first piece carries its id and name, later ones argument text)."""
        delta: dict = {}
        if d.reasoning:
            delta["reasoning_content"] = d.reasoning
        content = d.content if d.content is not None else d.text
        finish_reason = d.finish_reason
        if self.tool_parser is not None:
            stream = self.tool_streams.setdefault(index, ToolCallStream(self.tool_parser))
            content, calls = stream.feed(content)
            if finish_reason is not None:
                rest, more = stream.finish()
                content, calls = content + rest, calls + more
                if stream.calls and finish_reason == "stop":
                    finish_reason = "tool_calls"
            if calls:
                delta["tool_calls"] = [call.to_openai() for call in calls]
        if content:
            delta["content"] = content
        if not delta and finish_reason is None:
            delta["content"] = ""
        return delta, finish_reason

    def usage_chunk(self, outputs: list[RequestOutput]) -> dict:
        return self.chunk([], usage(outputs), with_usage=True)
