"""Headless Chromium (Debian's `chromium`) driven over the DevTools protocol, for the report's page tests.

Why the DevTools protocol rather than `--dump-dom` and a stderr log: it reports every console message,
uncaught exception and failed load as structured events tied to the page (no log parsing that a
Chromium release could change), and it evaluates script in the loaded page, so the test reads the
rendered DOM (sizes of the drawn SVG, the text a reader sees) rather than the file's source. One
browser serves several pages; the screenshot comes from the same loaded page.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from websockets.sync.client import connect

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars", "--remote-debugging-port=0"]
_START_TIMEOUT_S = 60
_CALL_TIMEOUT_S = 60


def chromium_path() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, "the report's page tests need Debian's chromium (apt-get install chromium; .ci/run installs it)"
    return path


class Browser:
    """One Chromium process; `open(url)` loads a page in a new tab and returns it."""

    def __init__(self, width: int = 1280, height: int = 2000):
        self.user_dir = tempfile.mkdtemp(prefix="batchgen-chromium-")
        self.width, self.height = width, height
        self.log = open(os.path.join(self.user_dir, "stderr.log"), "wb")  # noqa: SIM115 (open for the process life)
        self.process = subprocess.Popen(
            [chromium_path(), *CHROMIUM_FLAGS, f"--user-data-dir={self.user_dir}", f"--window-size={width},{height}",
             "about:blank"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self.log)
        port_file = Path(self.user_dir) / "DevToolsActivePort"  # Chromium writes its port and browser path
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not (port_file.exists() and len(port_file.read_text().split()) >= 2):
            assert self.process.poll() is None, f"chromium exited: {self._stderr()}"
            assert time.monotonic() < deadline, f"chromium did not open its DevTools port: {self._stderr()}"
            time.sleep(0.05)
        port, path = port_file.read_text().split()[:2]
        self._closing = contextlib.ExitStack()
        self.socket = self._closing.enter_context(
            connect(f"ws://127.0.0.1:{port}{path}", max_size=None, open_timeout=_START_TIMEOUT_S))
        self._next_id = 0
        self.events: list[dict] = []

    def _stderr(self) -> str:
        self.log.flush()
        return Path(self.user_dir, "stderr.log").read_text(errors="replace")[-2000:]

    def call(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        """Send one command and wait for its answer; events that arrive meanwhile are kept in `events`."""
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        self.socket.send(json.dumps(message))
        deadline = time.monotonic() + _CALL_TIMEOUT_S
        while True:
            reply = json.loads(self.socket.recv(timeout=max(0.1, deadline - time.monotonic())))
            if reply.get("id") == self._next_id:
                assert "error" not in reply, f"{method}: {reply['error']}"
                return reply["result"]
            self.events.append(reply)

    def wait_for(self, method: str, session: str) -> dict:
        for i, event in enumerate(self.events):
            if event.get("method") == method and event.get("sessionId") == session:
                return self.events.pop(i)
        deadline = time.monotonic() + _CALL_TIMEOUT_S
        while True:
            event = json.loads(self.socket.recv(timeout=max(0.1, deadline - time.monotonic())))
            if event.get("method") == method and event.get("sessionId") == session:
                return event
            self.events.append(event)

    def open(self, url: str) -> Page:
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable", session=session)
        self.call("Emulation.setDeviceMetricsOverride", {"width": self.width, "height": self.height,
                                                         "deviceScaleFactor": 1, "mobile": False}, session=session)
        self.call("Page.navigate", {"url": url}, session=session)
        self.wait_for("Page.loadEventFired", session)
        return Page(self, session)

    def close(self) -> None:
        try:
            self._closing.close()
        finally:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.log.close()
            shutil.rmtree(self.user_dir, ignore_errors=True)


class Page:
    def __init__(self, browser: Browser, session: str):
        self.browser = browser
        self.session = session

    def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page (JSON-able values)."""
        result = self.browser.call("Runtime.evaluate", {"expression": expression, "returnByValue": True},
                                   session=self.session)
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    def console_errors(self) -> list[str]:
        """Console errors, uncaught exceptions and failed loads reported for this page so far."""
        self.evaluate("0")  # a round trip: events sent before it have arrived
        errors = []
        for event in self.browser.events:
            if event.get("sessionId") != self.session:
                continue
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                errors.append(" ".join(str(a.get("value", a.get("description"))) for a in params.get("args", [])))
            elif method == "Runtime.exceptionThrown":
                errors.append(params["exceptionDetails"].get("text", "exception"))
            elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                errors.append(params["entry"].get("text", ""))
        return errors

    def screenshot(self, path: Path, full_page: bool = True) -> bytes:
        """A PNG of the page (the whole document when full_page), written to `path`."""
        height = self.evaluate("document.documentElement.scrollHeight") if full_page else self.browser.height
        shot = self.browser.call("Page.captureScreenshot", {
            "format": "png", "captureBeyondViewport": full_page,
            "clip": {"x": 0, "y": 0, "width": self.browser.width, "height": height, "scale": 1}},
            session=self.session)
        data = base64.b64decode(shot["data"])
        Path(path).write_bytes(data)
        return data
