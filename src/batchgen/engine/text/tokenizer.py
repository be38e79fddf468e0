"""Tokenizer and chat template through transformers' AutoTokenizer (it reads GGUF metadata too).

transformers renders chat templates in an ImmutableSandboxedEnvironment (sandboxed jinja2). Code
shipped with a model folder (an `auto_map` in its configs) is never run: trust_remote_code=False.
"""

from __future__ import annotations

import copy
import logging

from batchgen.engine.loader.gguf_layout import check_gguf_layout, read_gguf_header
from batchgen.engine.loader.source import ModelSource
from batchgen.engine.text.chat_template import DEFAULT_CHAT, PROBE_CONVERSATION, ChatTemplateOptions
from batchgen.engine.text.control_tokens import ControlTokens

Messages = list[dict]

# GGUF architectures whose tokenizer transformers builds from the file's tokenizer keys but whose config it
# does not read (AutoTokenizer needs both): their tokenizer is made by PreTrainedTokenizerFast directly.
TOKENIZER_ONLY_GGUF_ARCHITECTURES = ("glm4",)


class Tokenizer:
    def __init__(self, source: ModelSource):
        from transformers import AutoTokenizer

        logging.getLogger("transformers").setLevel(logging.ERROR)
        kwargs = {"gguf_file": source.gguf_file} if source.is_gguf else {}
        loader = AutoTokenizer
        if source.is_gguf:  # transformers parses it with gguf.GGUFReader, which trusts declared counts
            path = source.folder / source.gguf_file
            check_gguf_layout(path)
            if read_gguf_header(path).metadata.get("general.architecture") in TOKENIZER_ONLY_GGUF_ARCHITECTURES:
                from transformers import PreTrainedTokenizerFast as loader
        try:
            # local_files_only: the folder is already here (engine/loader/source.py found or fetched it);
            # nothing is looked up on a hub at run time.
            hf = loader.from_pretrained(str(source.folder), trust_remote_code=False, local_files_only=True, **kwargs)
        except Exception as exc:
            raise ValueError(f"cannot load the tokenizer of {source.display_name}: {exc}") from exc
        self._use(hf)

    def _use(self, hf) -> None:
        self.hf = hf
        self.eos_token_id = hf.eos_token_id
        self.has_chat_template = bool(getattr(hf, "chat_template", None))
        self.control_tokens = ControlTokens(hf)
        self._other_control_tokens: dict[str, ControlTokens] = {}  # per chat template given in place of the model's
        self._max_token_bytes: int | None = None

    def copy(self) -> Tokenizer:
        """An independent copy for another thread: a Rust tokenizer used by two threads at once fails
        ("Already borrowed"), since encoding switches its special-token mode."""
        other = object.__new__(Tokenizer)
        other._use(copy.deepcopy(self.hf))
        return other

    def render_chat(self, messages: Messages, options: ChatTemplateOptions = DEFAULT_CHAT) -> str:
        """The conversation as prompt text. ValueError when there is no template, or the template
        refuses these messages (its raise_exception, a wrong role order) or fails."""
        if options.chat_template is None and not self.has_chat_template:
            raise ValueError("this model has no chat template; send raw prompts (apply_chat_template: false) "
                             "or give one (--chat-template, input.chat_template, chat_template=)")
        options.check_messages(messages)
        from jinja2 import TemplateError

        try:
            return self.hf.apply_chat_template(
                list(messages), tokenize=False, chat_template=options.chat_template,
                add_generation_prompt=options.add_generation_prompt,
                continue_final_message=options.continue_final_message, tools=options.tools,
                **options.chat_template_kwargs)
        except TemplateError as exc:
            raise ValueError(f"the chat template cannot render these messages: {exc}") from None

    def check_chat_template(self, options: ChatTemplateOptions) -> None:
        """Render a one-message conversation: a template that cannot fails here, once, at start."""
        probe = ChatTemplateOptions(options.chat_template, chat_template_kwargs=options.chat_template_kwargs)
        try:
            self.render_chat(list(PROBE_CONVERSATION), probe)
        except ValueError as exc:
            raise ValueError(f"the chat template does not render a user message: {exc}") from None

    def encode(self, text: str, add_special_tokens: bool = True,
               allow_special_tokens: bool = True) -> list[int]:
        """`allow_special_tokens=False`: control-token text in `text` ("<|im_start|>") is encoded as text."""
        if allow_special_tokens or not self.control_tokens.holds_control_text(text):
            return self.control_tokens.encode(text, add_special_tokens=add_special_tokens)
        return self.control_tokens.encode_text(text, add_special_tokens)

    def encode_messages(self, messages: Messages, allow_special_tokens: bool = True,
                        options: ChatTemplateOptions = DEFAULT_CHAT) -> list[int]:
        """`allow_special_tokens=False`: control-token text in the messages' strings is encoded as text;
        the template's own control tokens stay control tokens."""
        def render(conversation: Messages) -> str:
            return self.render_chat(conversation, options)

        if allow_special_tokens:
            # The rendered template already holds every special token it wants (vLLM does the same).
            return self.encode(render(messages), add_special_tokens=False)
        return list(self._control_tokens_for(options.chat_template).encode_chat(messages, render))

    def _control_tokens_for(self, template: str | None) -> ControlTokens:
        """The control tokens a template writes (the model's own template: built once at load)."""
        if template is None:
            return self.control_tokens
        if template not in self._other_control_tokens:
            self._other_control_tokens[template] = ControlTokens(self.hf, template)
        return self._other_control_tokens[template]

    def encode_prompt(self, prompt: str | Messages, allow_special_tokens: bool = True,
                      options: ChatTemplateOptions = DEFAULT_CHAT) -> list[int]:
        """A string is a raw prompt; a list of messages goes through the chat template (`options`)."""
        if isinstance(prompt, str):
            return self.encode(prompt, allow_special_tokens=allow_special_tokens)
        return self.encode_messages(prompt, allow_special_tokens=allow_special_tokens, options=options)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def max_token_bytes(self) -> int:
        """The longest token's text in UTF-8 bytes (computed once: ~1 s for a 50k vocabulary): a text of
        B bytes holds at least B / this many tokens."""
        if self._max_token_bytes is None:
            texts = self.hf.batch_decode([[t] for t in range(len(self.hf))], skip_special_tokens=False)
            self._max_token_bytes = max(len(text.encode("utf-8", "surrogatepass")) for text in texts)
        return self._max_token_bytes

    def token_texts(self, token_ids: list[int]) -> list[str]:
        """Each token decoded alone, special tokens included (a partial UTF-8 sequence reads as U+FFFD)."""
        unique = list(dict.fromkeys(token_ids))
        texts = dict(zip(unique, self.hf.batch_decode([[t] for t in unique], skip_special_tokens=False)))
        return [texts[t] for t in token_ids]
