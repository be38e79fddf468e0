"""ServeConfig: the server's own settings (the engine's are EngineConfig's), one field per
`batchgen serve` flag. The command line builds it; its field docstrings are the flags' help."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from batchgen.engine.config import check_settings

# 8M tokens of text: more than any model's context, far less than what would exhaust the server's memory.
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 << 20
API_KEY_ENV = "BATCHGEN_API_KEY"
UvicornLogLevel = Literal["critical", "error", "warning", "info", "debug", "trace"]


@dataclass(frozen=True)
class ServeConfig:
    """How the server listens, whom it answers and how much it holds."""

    host: str = "127.0.0.1"
    """The address to bind; 0.0.0.0: every interface."""
    port: int = 8000
    """The port to listen on."""
    served_model_name: tuple[str, ...] | None = None
    """The name(s) clients send as `model`; null: MODEL_OR_JOB's model as given."""
    api_key: str | None = None
    """Require `Authorization: Bearer KEY` on /v1 (default: the BATCHGEN_API_KEY environment variable)."""
    max_queued_requests: int = 1024
    """Requests held beyond max_num_seqs (the ones that can run); past it, 503 with Retry-After."""
    max_queued_sequences: int = 16384
    """Sequences (prompts x n, or beams) held at once, running or waiting: a request that would pass it gets
    429 with Retry-After; one larger than it alone, 400."""
    health_stall_timeout: float = 120.0
    """/health answers 503 when the engine has work and has not finished a step for this many seconds."""
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    """A request body over this many bytes (default 32 MiB) gets 413 before the rest of it is read."""
    shutdown_timeout: float = 30.0
    """On SIGTERM/Ctrl-C, the seconds unfinished requests get before they end with an error."""
    chat_template: str | None = None
    """The chat template for /v1/chat/completions in place of the model's: a Jinja file, or the template
    text itself (default: the model's; a job file's input.chat_template)."""
    uvicorn_log_level: UvicornLogLevel = "info"
    """uvicorn's log level."""
    enable_auto_tool_choice: bool = False
    """Let chat requests use tool_choice auto: the model may call a tool, read from its output by
    --tool-call-parser (vLLM's flag; required and named tool choices need neither)."""
    lora_modules: tuple[str, ...] | None = None
    """LoRA adapters served by name (vLLM's flag): `name=path` entries, or vLLM's JSON form
    `{"name": ..., "path": ...}` (a PEFT folder or a Hugging Face repo id in the local cache); a request's `model: name` runs that adapter, /v1/models lists them. Turns
    enable_lora on."""

    def __post_init__(self) -> None:
        check_settings(self, [
            ("max_queued_requests", self.max_queued_requests >= 0, "must be >= 0"),
            ("max_queued_sequences", self.max_queued_sequences >= 1, "must be >= 1"),
            ("health_stall_timeout", self.health_stall_timeout > 0, "must be > 0"),
            ("max_request_body_bytes", self.max_request_body_bytes >= 1, "must be >= 1"),
            ("shutdown_timeout", self.shutdown_timeout >= 0, "must be >= 0"),
            ("lora_modules", all(_is_lora_module(m) for m in self.lora_modules or ()),
             "must be name=path (or JSON {name, path}) entries"),
        ])
        check_settings(self, [  # the entries read as name=path
            ("lora_modules", len(self.lora_paths) == len(self.lora_modules or ()), "must name each adapter once"),
            ("lora_modules", not set(self.lora_paths) & set(self.served_model_name or ()),
             "must not reuse a --served-model-name"),
        ])

    @property
    def lora_paths(self) -> dict[str, str]:
        """--lora-modules as {name: path}, in the order given."""
        return dict(_lora_module(m) for m in self.lora_modules or ())


def _lora_module(entry: str) -> tuple[str, str]:
    """`name=path`, or vLLM's JSON form `{"name": ..., "path": ..., "base_model_name": ...}`: (name, path);
    ValueError for anything else."""
    if entry.lstrip().startswith("{"):
        value = json.loads(entry)
        name, path = (value.get("name"), value.get("path")) if isinstance(value, dict) else (None, None)
        if not isinstance(name, str) or not isinstance(path, str):
            raise ValueError("a JSON entry needs string name and path")
    else:
        name, _, path = entry.partition("=")
    name, path = name.strip(), path.strip()
    if not name or not path:
        raise ValueError("needs a name and a path")
    return name, path


def _is_lora_module(entry: str) -> bool:
    try:
        _lora_module(entry)
    except ValueError:  # json.JSONDecodeError too
        return False
    return True
