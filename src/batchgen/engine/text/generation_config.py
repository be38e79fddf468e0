"""Sampling defaults from a model's generation_config.json, as vLLM reads them (`generation_config`).

`auto`: the model folder's generation_config.json when it has one (a .gguf file has none); `vllm`:
none; anything else: a folder that must hold one. Of the file, vLLM's keys count: temperature,
top_p, top_k, min_p, repetition_penalty, and max_new_tokens (as max_tokens). They fill only what a
request leaves unset: `LLM.generate(sampling_params=None)`, a server request's missing fields, a
job's sampling keys the job file does not set.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from batchgen.engine.loader.source import ModelSource

FILE_NAME = "generation_config.json"
AUTO, NONE = "auto", "vllm"
# generation_config.json key -> SamplingParams field (vLLM's list; HF's max_new_tokens is max_tokens).
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


@dataclass(frozen=True)
class GenerationDefaults:
    """What `generation_config` gave: the setting, the file read (None: none) and the SamplingParams
    defaults taken from it (field -> value)."""

    setting: str = NONE
    file: str | None = None
    values: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"setting": self.setting, "file": self.file, "values": dict(self.values)}

    def describe(self) -> str:
        if not self.values:
            where = f"{self.file} sets none" if self.file else "no generation_config.json"
            return f"generation_config {self.setting}: {where}; SamplingParams' defaults apply"
        shown = ", ".join(f"{k}={v}" for k, v in self.values.items())
        return f"generation_config {self.setting}: {shown} (from {self.file}; a request's own values win)"


def read_generation_defaults(setting: str, source: ModelSource | None) -> GenerationDefaults:
    """The defaults `setting` names for the model at `source`. ValueError naming the file for a
    folder without one, an unreadable file or a value of the wrong type."""
    if setting == NONE:
        return GenerationDefaults(NONE)
    if setting == AUTO:
        if source is None or source.is_gguf:
            return GenerationDefaults(AUTO)
        path = source.folder / FILE_NAME
        if not path.is_file():
            return GenerationDefaults(AUTO)
    else:
        path = Path(setting).expanduser()
        path = path if path.name == FILE_NAME and path.is_file() else path / FILE_NAME
        if not path.is_file():
            raise ValueError(f"generation_config {setting!r}: no {FILE_NAME} there (give auto, vllm, or a "
                             f"folder holding {FILE_NAME})")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    return parse_generation_config(text, setting, str(path))


def parse_generation_config(text: str, setting: str, where: str) -> GenerationDefaults:
    """The defaults in a generation_config.json's text (`where`: its path or URI, for messages)."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"cannot read {where}: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{where} is not a JSON object")  # noqa: TRY004 (a bad file, as a bad value in it)
    values = {}
    for key, name in SAMPLING_KEYS.items():
        value = raw.get(key)
        if value is None:
            continue
        is_int = name in ("top_k", "max_tokens")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (is_int and value != int(value)) \
                or not math.isfinite(value):
            raise ValueError(f"{where}: {key} must be {'an integer' if is_int else 'a number'}; got {value!r}")
        values[name] = int(value) if is_int else float(value)
    # transformers spells "no top-k" as 0; SamplingParams as -1.
    if values.get("top_k") == 0:
        values["top_k"] = -1
    return GenerationDefaults(setting, where, values)
