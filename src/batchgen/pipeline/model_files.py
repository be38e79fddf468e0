"""`batchgen validate`'s look at the model's files: everything the engine reads before its weights.

A GGUF file: its header and metadata, walked with the loader's own size checks (every count and
length against the file's bytes: engine/loader/gguf_layout.py), the config read from them, the
tokenizer's metadata (its model, a vocabulary of strings, ids inside it) and the chat template. An
HF folder: config.json, each safetensors file's header (engine/loader/safetensors_header.py), the
tokenizer (transformers reads its files, no weights) and its chat template. Each template is
compiled and rendered once on a one-message chat in transformers' sandbox. A damaged or hostile
file is a JobError naming the file and what is wrong, found in the time it takes to walk headers.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchgen.engine.loader.source import ModelSource
from batchgen.pipeline.config import JobConfig
from batchgen.pipeline.errors import JobError

_PROBE_CHAT = [{"role": "user", "content": "Hello"}]


def needs_chat_template(job: JobConfig) -> bool:
    """Whether the job needs the model's own chat template. A batch file's chat lines need the template
    and its completions lines do not: a chat line on a model without one becomes that line's error; any
    other job that applies the template needs one, unless input.chat_template gives its own."""
    return job.input.apply_chat_template and not job.input.is_batch_file and job.input.chat_template is None


@dataclass(frozen=True)
class ModelFiles:
    """What the model's files said: the template's presence and the vocabulary's size."""

    has_chat_template: bool
    num_tokens: int


def check_model_files(source: ModelSource, needs_chat_template: bool) -> ModelFiles:
    """JobError (naming `model.path`'s file and the problem) unless every file the engine reads before
    its weights is sound; `needs_chat_template`: the job renders chats, so the model must have one."""
    try:
        files = _check_gguf(source) if source.is_gguf else _check_hf_folder(source)
    except JobError:
        raise
    except (ValueError, OSError) as exc:  # the loader's own errors name the file
        raise JobError(f"model.path: {exc}") from None
    if needs_chat_template and not files.has_chat_template:
        raise JobError(f"model.path: {source.display_name} has no chat template; set "
                       "input.apply_chat_template: false and use prompt_column (raw prompts)")
    return files


def _check_gguf(source: ModelSource) -> ModelFiles:
    from batchgen.engine.loader.gguf_layout import GGUFArray, read_gguf_header
    from batchgen.engine.loader.gguf_loader import read_gguf_config

    path = source.folder / source.gguf_file
    header = read_gguf_header(path)  # GGUFLayoutError (a ValueError) names the file, the field, the byte
    read_gguf_config(path)  # the architecture and the keys the engine needs
    meta = header.metadata

    def fail(what: str) -> JobError:
        return JobError(f"model.path: GGUF file {path}: {what}")

    if not isinstance(meta.get("tokenizer.ggml.model"), str):
        raise fail("no tokenizer (metadata 'tokenizer.ggml.model' is missing or not a string)")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, GGUFArray) or not tokens.is_strings or not tokens.num_items:
        raise fail("no vocabulary (metadata 'tokenizer.ggml.tokens' is not a non-empty array of strings)")
    for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        per_token = meta.get(key)
        is_per_token = isinstance(per_token, GGUFArray) and per_token.num_items == tokens.num_items
        if per_token is not None and not is_per_token:
            raise fail(f"metadata {key!r} does not hold one item per token ({tokens.num_items})")
    for key in ("bos", "eos", "unknown", "padding"):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and not (isinstance(token_id, int) and 0 <= token_id < tokens.num_items):
            raise fail(f"metadata 'tokenizer.ggml.{key}_token_id' is {token_id!r}, not a token id of its "
                       f"{tokens.num_items}-token vocabulary")
    template = meta.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise fail("metadata 'tokenizer.chat_template' is not a string")
    if template:
        _check_template(template, f"GGUF file {path}: metadata 'tokenizer.chat_template'")
    return ModelFiles(bool(template), tokens.num_items)


def _check_hf_folder(source: ModelSource) -> ModelFiles:
    from batchgen.engine.loader.hf_loader import read_hf_config, safetensors_files
    from batchgen.engine.text.tokenizer import Tokenizer

    read_hf_config(source.folder)  # config.json: ValueError naming it
    safetensors_files(source.folder)  # each file's header against its length
    tokenizer = Tokenizer(source)
    template = getattr(tokenizer.hf, "chat_template", None)
    if isinstance(template, dict):  # named templates (older transformers)
        template = template.get("default")
    if template:
        _check_template(template, f"the chat template of {source.folder}")
    return ModelFiles(bool(template), len(tokenizer.hf))


def _check_template(template: str, where: str) -> None:
    """Compile and render it on a one-message chat, in transformers' sandbox (as the engine does)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        render_jinja_template(conversations=[_PROBE_CHAT], chat_template=template, add_generation_prompt=True,
                              bos_token="", eos_token="")
    except Exception as exc:
        raise JobError(f"model.path: {where} does not render a one-message chat: "
                       f"{type(exc).__name__}: {exc}") from None


def check_model_weights(source: ModelSource) -> tuple[int, int]:
    """`validate --weights`: every tensor of the model read and checked finite; (tensors, bytes read).
    A JobError naming `model.path`'s file and the damaged tensor otherwise."""
    from batchgen.engine.loader.model_loader import check_weights_finite

    try:
        return check_weights_finite(source)
    except (ValueError, OSError) as exc:
        raise JobError(f"model.path: {exc}") from None
