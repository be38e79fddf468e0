"""vLLM's tokenizer endpoints: /tokenize, /detokenize and /tokenizer_info.

lm-evaluation-harness' API models (`local-completions`) look for them: with both answering, it tokenizes
through the server ("remote" tokenizer backend), so a loglikelihood task needs no local copy of the
model's tokenizer. The tokenizer runs on the engine thread (engine_loop.py `call`), as every other use.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from pydantic import ValidationError

from batchgen.engine import LLMEngine
from batchgen.pipeline.openai.api_error import bad_request
from batchgen.pipeline.openai.protocol import ChatMessage, parse_json_object


def add_tokenizer_routes(app: FastAPI, state, check_key) -> None:
    """Register the three endpoints on `app` (`check_key(request)`: the server's API key check)."""

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        check_key(request)
        body = parse_json_object(await request.body())
        add_special_tokens = body.get("add_special_tokens", True)
        if not isinstance(add_special_tokens, bool):
            raise bad_request("add_special_tokens must be true or false", "add_special_tokens")
        if "messages" in body:
            messages = _messages(body["messages"])

            def encode(engine: LLMEngine) -> list[int]:
                return engine.tokenizer.encode_messages(messages)
        elif isinstance(body.get("prompt"), str):
            prompt = body["prompt"]

            def encode(engine: LLMEngine) -> list[int]:
                return engine.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        else:
            raise bad_request("prompt (a string) or messages is required", "prompt", "missing_required_parameter")
        tokens = await _on_engine(state, encode)
        return {"count": len(tokens), "max_model_len": state.max_model_len, "tokens": tokens, "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        check_key(request)
        body = parse_json_object(await request.body())
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise bad_request("tokens must be a list of token ids", "tokens")
        if any(t < 0 or t >= state.vocab_size for t in tokens):
            raise bad_request(f"tokens holds token ids outside [0, {state.vocab_size})", "tokens")
        text = await _on_engine(state, lambda engine: engine.tokenizer.decode(tokens, skip_special_tokens=False))
        return {"prompt": text}

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> dict:
        check_key(request)
        return await _on_engine(state, _info)


def _info(engine: LLMEngine) -> dict:
    hf = engine.tokenizer.hf
    return {"tokenizer_class": type(hf).__name__, "eos_token": hf.eos_token, "bos_token": hf.bos_token,
            "pad_token": hf.pad_token, "unk_token": hf.unk_token,
            "chat_template": getattr(hf, "chat_template", None), "model_max_length": engine.max_model_len}


def _messages(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise bad_request("messages must be a non-empty list of {role, content}", "messages")
    try:
        return [ChatMessage.model_validate(m).to_template(i) for i, m in enumerate(value)]
    except ValidationError as exc:
        raise bad_request(f"messages: {exc.errors()[0]['msg']}", "messages") from None


async def _on_engine(state, fn):
    try:
        return await state.loop.call(fn)
    except ValueError as exc:  # no chat template, an unreadable token
        raise bad_request(str(exc), "body") from None
