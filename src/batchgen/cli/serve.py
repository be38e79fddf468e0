"""`batchgen serve MODEL_OR_JOB [flags]`: the command line of the OpenAI-compatible server.

The engine flags are generated from EngineConfig's fields (one definition: a new engine setting is
a flag at once), named as vLLM names them: `max_num_seqs` is `--max-num-seqs`, a bool is
`--x/--no-x`, and VLLM_FLAG_NAMES lists where vLLM's name differs from the field's. Values are read
as YAML scalars (JSON for objects) and checked by constructing EngineConfig, whose rule a bad
value reports. A job file (`.yaml`/`.yml`) in place of a model gives its `model` and `engine`
sections; flags override them.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import os
import signal
import sys
import time
import typing
from pathlib import Path

import yaml
from pydantic import TypeAdapter, ValidationError

from batchgen.engine.text.chat_template import ChatTemplateOptions, check_template_syntax, load_chat_template
from batchgen.engine.config import EngineConfig, SettingError

log = logging.getLogger("batchgen.serve")

EXIT_BAD_USAGE = 2
# EngineConfig fields whose vLLM flag is not the field's name with dashes.
VLLM_FLAG_NAMES = {"speculative": "speculative-config"}
# What a 503 and the queue bound count: requests beyond the ones that can run (max_num_seqs).
DEFAULT_MAX_QUEUED_REQUESTS = 1024
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
# 8M tokens of text: more than any model's context, far less than what would exhaust the server's memory.
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 << 20
API_KEY_ENV = "BATCHGEN_API_KEY"


def engine_flag(name: str) -> str:
    return "--" + VLLM_FLAG_NAMES.get(name, name.replace("_", "-"))


def build_parser(config_class: type = EngineConfig) -> argparse.ArgumentParser:
    """The flags: the server's own, then one per field of `config_class` (EngineConfig)."""
    parser = argparse.ArgumentParser(
        prog="batchgen serve",
        description="An OpenAI-compatible server (/v1/chat/completions, /v1/completions, /v1/models, "
                    "/health, /metrics) on batchgen's engine.")
    parser.add_argument("model_or_job", metavar="MODEL_OR_JOB",
                        help="a model (bundled alias, HF folder, .gguf file, Hugging Face repo id) or a job "
                             "file whose model and engine sections to use")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default: %(default)s; 0.0.0.0: every interface)")
    server.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    server.add_argument("--served-model-name", nargs="+", default=None,
                        help="the name(s) clients send as `model` (default: MODEL_OR_JOB's model)")
    server.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                        help=f"require `Authorization: Bearer KEY` on /v1 (default: ${API_KEY_ENV})")
    server.add_argument("--max-queued-requests", type=int, default=DEFAULT_MAX_QUEUED_REQUESTS,
                        help="requests held beyond --max-num-seqs; past it, 503 with Retry-After "
                             "(default: %(default)s)")
    server.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                        help="a request body over this many bytes gets 413 before the rest of it is read "
                             "(default: %(default)s, 32 MiB)")
    server.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                        help="on SIGTERM/Ctrl-C, seconds unfinished requests get before they end with "
                             "an error (default: %(default)s)")
    server.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                        help="the chat template for /v1/chat/completions in place of the model's: a Jinja "
                             "file, or the template text itself (default: the model's; a job file's "
                             "input.chat_template)")
    server.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"],
                        help="(default: %(default)s)")
    engine = parser.add_argument_group("engine (EngineConfig's fields; default: the engine's or the job's)")
    hints = typing.get_type_hints(config_class)
    for f in dataclasses.fields(config_class):
        if f.name == "model":
            continue
        flag, default = engine_flag(f.name), f.default if f.default is not dataclasses.MISSING else None
        if hints[f.name] is bool:
            engine.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=f"{f.name} (engine default: {default})")
        else:
            engine.add_argument(flag, dest=f.name, metavar="VALUE", default=argparse.SUPPRESS,
                                help=f"{f.name} (engine default: {default})")
    return parser


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from MODEL_OR_JOB and the engine flags given; raises ValueError naming the flag."""
    target = args.model_or_job
    hints = typing.get_type_hints(EngineConfig)
    flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if hasattr(args, f.name)}
    values = {}
    for name, raw in flags.items():
        value = raw if isinstance(raw, bool) else yaml.safe_load(raw)
        try:
            values[name] = TypeAdapter(hints[name]).validate_python(value)
        except ValidationError:
            raise ValueError(f"{engine_flag(name)}: cannot read {raw!r} as {hints[name]}") from None
    if Path(target).suffix in (".yaml", ".yml") and Path(target).is_file():
        from batchgen.pipeline.config import load_job

        job = load_job(target)
        base = job.engine_config()
        if "generation_config" not in job.model.model_fields_set:
            # A job's default (vllm: its sampling section is its defaults) is not a server's: unset
            # request fields take the model's generation_config.json, as vLLM's server does.
            values.setdefault("generation_config", EngineConfig.generation_config)
        try:
            return base.replace(**values)
        except SettingError as exc:
            raise ValueError(f"{engine_flag(exc.name)} {exc.rule} (got {exc.value!r})") from None
    try:
        return EngineConfig(model=target, **values)
    except SettingError as exc:
        raise ValueError(f"{engine_flag(exc.name)} {exc.rule} (got {exc.value!r})") from None


def chat_options_from_args(args: argparse.Namespace) -> ChatTemplateOptions:
    """--chat-template (a file or the template's text), else a job file's input.chat_template and
    chat_template_kwargs; the template's syntax is checked here, before any model loads."""
    template, kwargs = None, {}
    target = args.model_or_job
    if Path(target).suffix in (".yaml", ".yml") and Path(target).is_file():
        from batchgen.pipeline.config import load_job

        job = load_job(target)
        template, kwargs = job.input.chat_template, job.input.chat_template_kwargs
    if args.chat_template is not None:
        template = load_chat_template(args.chat_template)
    if template is not None:
        check_template_syntax(template)
    return ChatTemplateOptions(template, chat_template_kwargs=kwargs)


def serve_main(argv: list[str]) -> int:
    """Parse, load the model, serve until SIGTERM/Ctrl-C; 0 after a graceful shutdown."""
    args = build_parser().parse_args(argv)
    missing = [name for name in ("fastapi", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        print(f"batchgen serve: needs the serve extra (pip install 'batchgen[serve]'): no {', '.join(missing)}",
              file=sys.stderr)
        return 1
    import uvicorn

    from batchgen.pipeline.errors import JobError

    try:
        config = engine_config_from_args(args)
    except (ValueError, JobError) as exc:
        print(f"batchgen serve: {exc}", file=sys.stderr)
        return EXIT_BAD_USAGE
    if args.max_queued_requests < 0 or args.shutdown_timeout < 0:
        print("batchgen serve: --max-queued-requests and --shutdown-timeout must be >= 0", file=sys.stderr)
        return EXIT_BAD_USAGE
    if args.max_request_body_bytes < 1:
        print("batchgen serve: --max-request-body-bytes must be >= 1", file=sys.stderr)
        return EXIT_BAD_USAGE
    try:
        chat = chat_options_from_args(args)
    except (ValueError, JobError) as exc:
        print(f"batchgen serve: --chat-template: {exc}", file=sys.stderr)
        return EXIT_BAD_USAGE

    from batchgen.engine import LLMEngine
    from batchgen.serve.app import ServerSettings, ServerState, create_app
    from batchgen.serve.engine_loop import EngineLoop
    from batchgen.serve.metrics import Metrics
    from batchgen.serve.prompt_encoder import PromptEncoder

    engine = LLMEngine(config)
    if chat.chat_template is not None or chat.chat_template_kwargs:
        try:  # once, at start: a template that cannot render fails here, not in every request
            engine.tokenizer.check_chat_template(chat)
        except ValueError as exc:
            print(f"batchgen serve: --chat-template: {exc}", file=sys.stderr)
            return EXIT_BAD_USAGE
    log.info("sampling defaults: %s", engine.generation_defaults.describe())
    names = args.served_model_name or [config.model]
    settings = ServerSettings(served_model_names=names, model_path=config.model, api_key=args.api_key,
                              max_in_flight=config.max_num_seqs + args.max_queued_requests,
                              max_request_body_bytes=args.max_request_body_bytes,
                              chat_template=chat.chat_template, seed=config.seed,
                              sampling_defaults=dict(engine.generation_defaults.values),
                              chat_template_kwargs=dict(chat.chat_template_kwargs))
    metrics = Metrics(names[0])
    loop = EngineLoop(engine, metrics)
    state = ServerState(loop, settings, metrics, engine.max_model_len, engine.model_cfg.vocab_size,
                        encoder=PromptEncoder(engine.tokenizer))
    app = create_app(state)

    stop_signal_time: list[float] = []

    def begin_shutdown() -> None:
        stop_signal_time.append(time.monotonic())
        state.shutting_down = True
        loop.fail_all_after(args.shutdown_timeout)

    # uvicorn waits for open responses this long; the engine ends the unfinished ones with an error at
    # --shutdown-timeout, and the margin lets those last events reach their clients.
    uvicorn_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                    timeout_graceful_shutdown=args.shutdown_timeout + 2)
    server = _Server(uvicorn_config, begin_shutdown)
    loop.start()
    # uvicorn re-raises the signal it stopped on once it has shut down: a no-op handler (restored by
    # uvicorn first) makes that harmless, so a graceful shutdown exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    log.info("serving %s as %s on http://%s:%d", config.model, ", ".join(names), args.host, args.port)
    try:
        server.run()
    finally:
        took = f" {time.monotonic() - stop_signal_time[0]:.1f}s after the stop signal" if stop_signal_time else ""
        log.info("the HTTP server stopped%s; stopping the engine thread", took)
        loop.stop()
        state.encoder.close()
    log.info("stopped")
    return 0


def _make_server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, telling the engine loop when the first stop signal arrives."""

        def __init__(self, config, on_stop):
            super().__init__(config)
            self.on_stop = on_stop

        def handle_exit(self, sig, frame) -> None:
            if not self.should_exit:
                self.on_stop()
            super().handle_exit(sig, frame)

    return Server


def _Server(config, on_stop):
    return _make_server_class()(config, on_stop)
