"""Run the server: load the engine, build the app, serve with uvicorn until SIGTERM/Ctrl-C, then end
the unfinished requests within the shutdown timeout and stop the engine thread."""

from __future__ import annotations

import logging
import signal
import sys
import time

from batchgen.engine import LLMEngine
from batchgen.engine.config import EngineConfig
from batchgen.engine.text.chat_template import ChatTemplateOptions
from batchgen.serve.app import ServerSettings, ServerState, create_app
from batchgen.serve.engine_loop import EngineLoop
from batchgen.serve.metrics import Metrics
from batchgen.serve.prompt_encoder import PromptEncoder
from batchgen.serve.request_bounds import max_prompt_bytes
from batchgen.serve.settings import ServeConfig

log = logging.getLogger("batchgen.serve")

EXIT_BAD_USAGE = 2


def run_server(config: EngineConfig, serve: ServeConfig, chat: ChatTemplateOptions) -> int:
    """Load the model, serve until SIGTERM/Ctrl-C; 0 after a graceful shutdown, 2 when the chat
    template cannot render (checked once, before serving)."""
    import uvicorn

    if serve.lora_modules and not config.enable_lora:
        config = config.replace(enable_lora=True)
    engine = LLMEngine(config)
    try:  # every adapter read and checked once, before serving
        lora_requests = lora_requests_from(serve.lora_paths, engine)
    except ValueError as exc:
        print(f"batchgen serve: --lora-modules: {exc}", file=sys.stderr)
        return EXIT_BAD_USAGE
    if chat.chat_template is not None or chat.chat_template_kwargs:
        try:  # once, at start: a template that cannot render fails here, not in every request
            engine.tokenizer.check_chat_template(chat)
        except ValueError as exc:
            print(f"batchgen serve: --chat-template: {exc}", file=sys.stderr)
            return EXIT_BAD_USAGE
    log.info("sampling defaults: %s", engine.generation_defaults.describe())
    names = list(serve.served_model_name or [config.model])
    settings = ServerSettings(served_model_names=names, model_path=config.model, api_key=serve.api_key,
                              max_in_flight=config.max_num_seqs + serve.max_queued_requests,
                              max_in_flight_seqs=serve.max_queued_sequences,
                              max_request_body_bytes=serve.max_request_body_bytes,
                              chat_template=chat.chat_template, seed=config.seed,
                              sampling_defaults=dict(engine.generation_defaults.values),
                              chat_template_kwargs=dict(chat.chat_template_kwargs),
                              tool_call_parser=config.tool_call_parser,
                              enable_auto_tool_choice=serve.enable_auto_tool_choice,
                              lora_requests=lora_requests)
    metrics = Metrics(names[0])
    loop = EngineLoop(engine, metrics)
    state = ServerState(loop, settings, metrics, engine.max_model_len, engine.model_cfg.vocab_size,
                        encoder=PromptEncoder(engine.tokenizer),
                        max_prompt_bytes=max_prompt_bytes(engine.max_model_len, engine.tokenizer.max_token_bytes()),
                        health_stall_timeout=serve.health_stall_timeout)
    app = create_app(state)

    stop_signal_time: list[float] = []

    def begin_shutdown() -> None:
        stop_signal_time.append(time.monotonic())
        state.shutting_down = True
        loop.fail_all_after(serve.shutdown_timeout)

    # uvicorn waits for open responses this long; the engine ends the unfinished ones with an error at
    # --shutdown-timeout, and the margin lets those last events reach their clients.
    uvicorn_config = uvicorn.Config(app, host=serve.host, port=serve.port, log_level=serve.uvicorn_log_level,
                                    timeout_graceful_shutdown=serve.shutdown_timeout + 2)
    server = _Server(uvicorn_config, begin_shutdown)
    loop.start()
    # uvicorn re-raises the signal it stopped on once it has shut down: a no-op handler (restored by
    # uvicorn first) makes that harmless, so a graceful shutdown exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    log.info("serving %s as %s on http://%s:%d", config.model, ", ".join(names), serve.host, serve.port)
    try:
        server.run()
    finally:
        took = f" {time.monotonic() - stop_signal_time[0]:.1f}s after the stop signal" if stop_signal_time else ""
        log.info("the HTTP server stopped%s; stopping the engine thread", took)
        loop.stop()
        state.encoder.close()
    log.info("stopped")
    return 0


def lora_requests_from(paths: dict[str, str], engine: LLMEngine) -> dict:
    """{name: LoRARequest} for --lora-modules (ids 1, 2, ... in the order given), each read by the engine."""
    from batchgen.engine.lora import LoRARequest

    requests = {}
    for i, (name, path) in enumerate(paths.items()):
        requests[name] = LoRARequest(name, i + 1, path)
        engine.add_lora(requests[name])
    return requests


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
