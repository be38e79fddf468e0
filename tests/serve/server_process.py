"""Start `batchgen serve` as a subprocess on 127.0.0.1 and a free port, and wait until it answers."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.conftest import MODEL, TEST_ENGINE_KWARGS

BOOT_TIMEOUT_S = 300  # loading the model on a busy 2-core machine


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def engine_flags(kwargs: dict = TEST_ENGINE_KWARGS) -> list[str]:
    """The test engine settings as `batchgen serve` flags (the same engine as the `llm` fixture)."""
    return [arg for key, value in kwargs.items() for arg in (f"--{key.replace('_', '-')}", str(value))]


class ServerProcess:
    def __init__(self, log_path: Path, *flags: str, model: str = MODEL, env: dict[str, str] | None = None):
        """`batchgen serve MODEL` with the test engine flags and `flags`; `env`: variables to add."""
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "wb")
        cmd = [sys.executable, "-m", "batchgen.cli.main", "serve", model, "--host", "127.0.0.1",
               "--port", str(self.port), "--uvicorn-log-level", "warning", *engine_flags(), *flags]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})

    def wait_ready(self) -> ServerProcess:
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"the server did not come up in {BOOT_TIMEOUT_S}s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-5000:]

    def metrics(self) -> dict[str, float]:
        """`/metrics` as {name{labels}: value}, plus bare names for the unlabelled-by-reason ones."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        values = {}
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
            values[re.sub(r"\{.*\}", "", name)] = float(value)
        return values

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self.log.close()
