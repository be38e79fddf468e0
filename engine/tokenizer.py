"""Tokenizer and chat template through transformers' AutoTokenizer (it reads GGUF metadata too).

transformers renders chat templates in an ImmutableSandboxedEnvironment (sandboxed jinja2). Code
shipped with a model folder (an `auto_map` in its configs) is never run: trust_remote_code=False.
"""

from __future__ import annotations

import copy
import logging
import os

from batchgen.engine.control_tokens import ControlTokens
from batchgen.engine.loader.gguf_layout import check_gguf_layout
from batchgen.engine.loader.source import ModelSource

Messages = list[dict]


class Tokenizer:
    def __init__(self, source: ModelSource):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub at run time
        from transformers import AutoTokenizer

        logging.getLogger("transformers").setLevel(logging.ERROR)
        kwargs = {"gguf_file": source.gguf_file} if source.is_gguf else {}
        if source.is_gguf:  # transformers parses it with gguf.GGUFReader, which trusts declared counts
            check_gguf_layout(source.folder / source.gguf_file)
        try:
            hf = AutoTokenizer.from_pretrained(str(source.folder), trust_remote_code=False, **kwargs)
        except Exception as exc:
            raise ValueError(f"cannot load the tokenizer of {source.display_name}: {exc}") from exc
        self._use(hf)

    def _use(self, hf) -> None:
        self.hf = hf
        self.eos_token_id = hf.eos_token_id
        self.has_chat_template = bool(getattr(hf, "chat_template", None))
        self.control_tokens = ControlTokens(hf)

    def copy(self) -> Tokenizer:
        """An independent copy for another thread: a Rust tokenizer used by two threads at once fails
        ("Already borrowed"), since encoding switches its special-token mode."""
        other = object.__new__(Tokenizer)
        other._use(copy.deepcopy(self.hf))
        return other

    def render_chat(self, messages: Messages) -> str:
        if not self.has_chat_template:
            raise ValueError("this model has no chat template; send raw prompts (apply_chat_template: false)")
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def encode(self, text: str, add_special_tokens: bool = True,
               allow_special_tokens: bool = True) -> list[int]:
        """`allow_special_tokens=False`: control-token text in `text` ("<|im_start|>") is encoded as text."""
        if allow_special_tokens or not self.control_tokens.holds_control_text(text):
            return self.control_tokens.encode(text, add_special_tokens=add_special_tokens)
        return self.control_tokens.encode_text(text, add_special_tokens)

    def encode_messages(self, messages: Messages, allow_special_tokens: bool = True) -> list[int]:
        """`allow_special_tokens=False`: control-token text in the messages' strings is encoded as text;
        the template's own control tokens stay control tokens."""
        if allow_special_tokens:
            # The rendered template already holds every special token it wants (vLLM does the same).
            return self.encode(self.render_chat(messages), add_special_tokens=False)
        return list(self.control_tokens.encode_chat(messages, self.render_chat))

    def encode_prompt(self, prompt: str | Messages, allow_special_tokens: bool = True) -> list[int]:
        """A string is a raw prompt; a list of messages goes through the chat template."""
        if isinstance(prompt, str):
            return self.encode(prompt, allow_special_tokens=allow_special_tokens)
        return self.encode_messages(prompt, allow_special_tokens=allow_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_texts(self, token_ids: list[int]) -> list[str]:
        """Each token decoded alone, special tokens included (a partial UTF-8 sequence reads as U+FFFD)."""
        unique = list(dict.fromkeys(token_ids))
        texts = dict(zip(unique, self.hf.batch_decode([[t] for t in unique], skip_special_tokens=False)))
        return [texts[t] for t in token_ids]
