"""A real llmc server on a loopback port, run in a thread of the test process.

The app, engine loop, engine and uvicorn server are the production ones (`create_app`,
`GracefulServer`); only the signal handling is left out, since it runs outside the main thread:
`stop()` asks for the same graceful shutdown a SIGTERM does. Tests reach the engine through
`server.loop.engine` to read its block manager or to inject a failing step.
"""

from __future__ import annotations

import re
import threading
import time

import httpx

from llmc.runtime.engine import Engine
from llmc.runtime.server import GracefulServer, ServerConfig, bind_socket, create_app


class LiveServer:
    def __init__(self, engine: Engine, config: ServerConfig = ServerConfig()):
        self.app = create_app(engine, config)
        self.loop = self.app.state.loop
        self.config = self.app.state.config
        sock = bind_socket("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self._server = GracefulServer(self.app)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            assert time.monotonic() < deadline, "the test server did not start in 30 s"
            time.sleep(0.02)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=60)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, by its name and labels as printed."""
        text = httpx.get(f"{self.url}/metrics").text
        return {m.group(1): float(m.group(2)) for m in re.finditer(r"^([^#\s][^ ]*) (\S+)$", text, re.M)}

    def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        """Metrics once no request runs or waits and every KV block is free again."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["llmc_num_requests_running"] == m["llmc_num_requests_waiting"] == m["llmc_kv_blocks_used"] == 0:
                return m
            assert time.monotonic() < deadline, f"the engine did not go idle in {timeout} s: {m}"
            time.sleep(0.05)
