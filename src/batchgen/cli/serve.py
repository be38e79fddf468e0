"""`batchgen serve MODEL_OR_JOB [flags]`: an OpenAI-compatible server on the engine.

The command's parameters are not written here: serve_flags.py builds its signature from ServeConfig's
and EngineConfig's fields, and typer reads that signature as it reads a written one (typer is click
underneath; ServeCommand adds vLLM's `--served-model-name A B`). The server itself is batchgen.serve's.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from typing import Any

import typer
from typer.core import TyperCommand

from batchgen.cli.console import EXIT_BAD_JOB, EXIT_FAILURE, setup_logging
from batchgen.cli.serve_flags import ServeCommand, ServeFlags, serve_signature
from batchgen.engine.config import EngineConfig
from batchgen.pipeline.errors import JobError

SERVE_HELP = """An OpenAI-compatible server on the engine (/v1/chat/completions, /v1/completions, /v1/models, ...).

Serves /v1/chat/completions, /v1/completions, /v1/models, /health and /metrics; needs the serve extra
(pip install 'batchgen\\[serve]': fastapi, uvicorn). Every engine setting is a flag, named as vLLM names
it (`--max-num-seqs 64`, `--no-enable-prefix-caching`); a job file in place of a model gives its model
and engine sections, which flags override."""


def serve_function(config_class: type = EngineConfig) -> Callable[..., None]:
    """The `batchgen serve` callback with its generated signature, for typer to register."""

    def serve(**params: Any) -> None:
        raise typer.Exit(serve_main(ServeFlags.from_params(params, config_class)))

    serve.__signature__ = serve_signature(config_class)
    serve.__doc__ = SERVE_HELP
    return serve


def register_serve(app: typer.Typer, config_class: type = EngineConfig) -> None:
    """Add `serve` to `app`, with one engine flag per field of `config_class`."""
    app.command("serve", cls=ServeCommand)(serve_function(config_class))


def serve_command(config_class: type = EngineConfig) -> TyperCommand:
    """`batchgen serve` alone, as click runs it (what tests and the reference read)."""
    app = typer.Typer(add_completion=False)
    register_serve(app, config_class)
    return typer.main.get_command(app)


def parse_serve_flags(argv: list[str], config_class: type = EngineConfig) -> ServeFlags:
    """A `batchgen serve` argument list, read as the command reads it (usage errors raise click's)."""
    ctx = serve_command(config_class).make_context("serve", list(argv))
    return ServeFlags.from_params(ctx.params, config_class)


def serve_main(flags: ServeFlags) -> int:
    """Check the flags, load the model, serve until SIGTERM/Ctrl-C; 0 after a graceful shutdown, 2 for a
    bad value, 1 without the serve extra."""
    setup_logging()
    missing = [name for name in ("fastapi", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        print(f"batchgen serve: needs the serve extra (pip install 'batchgen[serve]'): no {', '.join(missing)}",
              file=sys.stderr)
        return EXIT_FAILURE
    try:
        config = flags.engine_config()
        settings = flags.serve_config()
    except (ValueError, JobError) as exc:
        print(f"batchgen serve: {exc}", file=sys.stderr)
        return EXIT_BAD_JOB
    try:
        chat = flags.chat_options()
    except (ValueError, JobError) as exc:
        print(f"batchgen serve: --chat-template: {exc}", file=sys.stderr)
        return EXIT_BAD_JOB
    from batchgen.serve.server import run_server

    return run_server(config, settings, chat)
