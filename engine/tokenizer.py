"""Tokenizer and chat template through transformers' AutoTokenizer (it reads GGUF metadata too).

transformers renders chat templates in an ImmutableSandboxedEnvironment (sandboxed jinja2).
"""

from __future__ import annotations

import logging
import os

from batchgen.engine.loader.source import ModelSource

Messages = list[dict]


class Tokenizer:
    def __init__(self, source: ModelSource):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub at run time
        from transformers import AutoTokenizer

        logging.getLogger("transformers").setLevel(logging.ERROR)
        kwargs = {"gguf_file": source.gguf_file} if source.is_gguf else {}
        try:
            self.hf = AutoTokenizer.from_pretrained(str(source.folder), **kwargs)
        except Exception as exc:
            raise ValueError(f"cannot load the tokenizer of {source.display_name}: {exc}") from exc
        self.eos_token_id = self.hf.eos_token_id
        self.has_chat_template = bool(getattr(self.hf, "chat_template", None))

    def render_chat(self, messages: Messages) -> str:
        if not self.has_chat_template:
            raise ValueError("this model has no chat template; send raw prompts (apply_chat_template: false)")
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def encode_messages(self, messages: Messages) -> list[int]:
        # The rendered template already holds every special token it wants (vLLM does the same).
        return self.encode(self.render_chat(messages), add_special_tokens=False)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)
