"""vLLM's tokenizer endpoints: /tokenize, /detokenize and /tokenizer_info.

lm-evaluation-harness' API models (`local-completions`) look for them: with both answering, it tokenizes
through the server ("remote" tokenizer backend), so a loglikelihood task needs no local copy of the
model's tokenizer. The tokenizer runs on the engine thread (engine_loop.py `call`), as every other use,
except for a large prompt, which the prompt encoder's own thread encodes (prompt_encoder.py). Messages
render as a chat completion's would: the server's template (--chat-template) and template variables,
the body's `add_generation_prompt`, `continue_final_message` and `chat_template_kwargs`, control-token
text in their content encoded as text; the body is read up to --max-request-body-bytes.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from pydantic import ValidationError

from batchgen.engine import LLMEngine
from batchgen.engine.text.chat_template import DEFAULT_CHAT, ChatTemplateOptions
from batchgen.openai.api_error import bad_request
from batchgen.openai.protocol import ChatMessage, parse_json_object
from batchgen.serve.prompt_encoder import encode_prompt, is_large
from batchgen.serve.request_body import read_body


def add_tokenizer_routes(app: FastAPI, state, check_key) -> None:
    """Register the three endpoints on `app` (`check_key(request)`: the server's API key check)."""

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        check_key(request)
        body = parse_json_object(await read_body(request, state.settings.max_request_body_bytes))
        add_special_tokens = body.get("add_special_tokens", True)
        if not isinstance(add_special_tokens, bool):
            raise bad_request("add_special_tokens must be true or false", "add_special_tokens")
        if "messages" in body:
            prompt, field, chat = _messages(body["messages"]), "messages", _chat_options(body, state.settings)
        elif isinstance(body.get("prompt"), str):
            prompt, field, chat = body["prompt"], "prompt", DEFAULT_CHAT
        else:
            raise bad_request("prompt (a string) or messages is required", "prompt", "missing_required_parameter")
        if field == "prompt" and not add_special_tokens:
            tokens = await _on_engine(state, lambda engine: engine.tokenizer.encode(prompt, add_special_tokens=False))
        elif is_large(prompt) and state.encoder is not None:  # off the engine thread, as a completion's
            tokens = await state.encoder.encode(prompt, field, chat)
        else:
            tokens = await _on_engine(state, lambda engine: encode_prompt(engine.tokenizer, prompt, field, chat))
        return {"count": len(tokens), "max_model_len": state.max_model_len, "tokens": tokens, "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        check_key(request)
        body = parse_json_object(await read_body(request, state.settings.max_request_body_bytes))
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


def _chat_options(body: dict, settings) -> ChatTemplateOptions:
    """A chat completion's rendering: the server's template and variables under the body's fields."""
    flags = {}
    for name, default in (("add_generation_prompt", True), ("continue_final_message", False)):
        flags[name] = body.get(name, default)
        if not isinstance(flags[name], bool):
            raise bad_request(f"{name} must be true or false", name)
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise bad_request("chat_template_kwargs must be an object", "chat_template_kwargs")
    try:
        return ChatTemplateOptions(settings.chat_template, flags["add_generation_prompt"],
                                   flags["continue_final_message"], {**settings.chat_template_kwargs, **kwargs})
    except ValueError as exc:
        raise bad_request(str(exc), "chat_template_kwargs") from None


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
