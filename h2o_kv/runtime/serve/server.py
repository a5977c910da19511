"""uvicorn for one app and its engine: graceful shutdown that ends every stream cleanly, and a
background-thread runner (tests and the load generator serve on an ephemeral loopback port)."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from h2o_kv.runtime.serve.timeouts import header_timeout


class Server(uvicorn.Server):
    """On SIGTERM/SIGINT the engine drains for `drain_timeout` seconds, then ends what is left, so
    every open stream gets its final chunk and `data: [DONE]` before uvicorn closes the connections. While it
    drains the server still accepts connections and answers new requests 503 (`app.state.draining`), so a
    client reads why instead of a refused connection."""

    def __init__(self, config: uvicorn.Config, engine, drain_timeout: float, announce: str | None = None) -> None:
        super().__init__(config)
        self.engine, self.drain_timeout, self.announce = engine, drain_timeout, announce

    @classmethod
    def for_app(cls, app, engine, *, host: str = "127.0.0.1", port: int = 8000, drain_timeout: float = 30.0,
                log_level: str = "info", max_connections: int | None = None, announce: str | None = None,
                ) -> Server:  # fmt: skip
        """`announce`: what it serves with, printed once it listens (`h2o-kv serve: ready at URL: ANNOUNCE`)."""
        # uvicorn waits a little longer than the engine, so the engine's clean ending comes first
        # request headers must arrive within the app's read timeout (timeouts.py)
        http = header_timeout(app.state.limits.read_timeout, app.state.metrics)
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, limit_concurrency=max_connections,
                                timeout_graceful_shutdown=drain_timeout + 5, http=http)  # fmt: skip
        return cls(config, engine, drain_timeout, announce)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.announce:  # after uvicorn's own line, with the port it bound
            host = self.config.host
            url = f"http://{f'[{host}]' if ':' in host else host}:{self.port}"
            print(f"h2o-kv serve: ready at {url}: {self.announce}", file=sys.stderr, flush=True)

    async def shutdown(self, sockets=None) -> None:
        self.config.app.state.draining = True  # new requests: 503 while the admitted ones finish
        await self._end_engine()
        await super().shutdown(sockets)

    async def _end_engine(self) -> None:
        """Let admitted and queued requests finish for up to `drain_timeout` s, then cancel the rest
        (their streams end with finish_reason "cancelled" and `data: [DONE]`) and stop the engine."""
        deadline = time.monotonic() + self.drain_timeout
        while time.monotonic() < deadline:
            stats = await asyncio.to_thread(self.engine.stats)  # waits for the step in flight, off the loop
            if not stats["running"] and not stats["waiting"]:
                break
            await asyncio.sleep(0.05)
        await asyncio.to_thread(self.engine.shutdown, drain=False)

    @property
    def port(self) -> int:
        return self.servers[0].sockets[0].getsockname()[1]


@contextmanager
def serve_in_thread(app, engine, *, drain_timeout: float = 5.0, start_timeout: float = 30.0,
                    announce: str | None = None) -> Iterator[str]:  # fmt: skip
    """Serve `app` on 127.0.0.1 at an ephemeral port in a background thread; yields the base URL
    (http://127.0.0.1:PORT) and shuts the server down on exit."""
    server = Server.for_app(app, engine, port=0, drain_timeout=drain_timeout, log_level="warning", announce=announce)
    thread = threading.Thread(target=server.run, name="h2o-kv-serve", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start (see the log above)")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=drain_timeout + 30)
