"""Timeouts for clients that are slow to send a request or stop reading a stream (`serve --read-timeout`,
`--stream-timeout`).

Three ways a client can hold a connection (and, while it streams, a request's KV rows) without doing its part:
- it opens a connection and sends its headers slowly, or not at all: `HeaderTimeout` (uvicorn's h11
  protocol with a timer) closes a connection whose request headers are not complete `read_timeout` seconds
  after it opened or after its last response;
- it sends the headers and then its body slowly: `ClientTimeouts` reads the body within `read_timeout`
  seconds of the headers, else answers 408 and closes;
- it stops reading a stream: once the socket's buffers are full a write blocks; a write that has not gone
  out after `stream_timeout` seconds cancels the request (its KV rows are freed at the engine's next step)
  and ends the connection. The server's socket send buffer is set to 64 KiB (the kernel otherwise grows it
  to megabytes, which on loopback absorbed a whole 8,000-token stream), so an unread stream blocks after
  a few hundred tokens.
Each timeout counts in `h2o_kv_client_timeouts_total{kind="header"|"body"|"stream"}`.
"""

from __future__ import annotations

import asyncio
import json
import socket

from uvicorn.protocols.http.h11_impl import H11Protocol

from h2o_kv.runtime.serve import schemas

SEND_BUFFER = 64 << 10  # bytes: a few hundred tokens of a stream (~100-200 bytes each), KB/s of text either way
ABANDON = "h2o_kv.abandon"  # scope key: the streaming endpoint's hook that cancels its request


class ClientStalled(Exception):
    """A stream's client read nothing for `stream_timeout` seconds; its request was cancelled."""


def header_timeout(seconds: float, metrics) -> type[H11Protocol]:
    """uvicorn's h11 protocol closing connections whose request headers take more than `seconds` to arrive."""

    class HeaderTimeout(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            sock = transport.get_extra_info("socket")
            if sock is not None:  # a bounded send buffer: an unread stream blocks after ~64 KiB, not megabytes
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def _arm(self) -> None:
            self.loop.call_later(seconds, self._expire, self.cycle)

        def _expire(self, cycle) -> None:
            if self.cycle is cycle and not self.transport.is_closing():  # no request began since it was armed
                metrics.timeouts.labels("header").inc()
                self.transport.close()

    return HeaderTimeout


class ClientTimeouts:
    """ASGI middleware: the request body within `read_timeout` s (else 408), each stream write within
    `stream_timeout` s (else the request is cancelled and the connection ended). Bodies larger than
    `max_body_bytes` or without a length are left to the app, which refuses them without reading."""

    def __init__(self, app, *, read_timeout: float, stream_timeout: float, max_body_bytes: int, metrics) -> None:
        self.app, self.read_timeout, self.stream_timeout = app, read_timeout, stream_timeout
        self.max_body_bytes, self.metrics = max_body_bytes, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) <= self.max_body_bytes:
            try:
                messages = await asyncio.wait_for(_read_body(receive), self.read_timeout)
            except TimeoutError:
                self.metrics.timeouts.labels("body").inc()
                return await _request_timeout(send, self.read_timeout)
            receive = _replay(messages, receive)

        async def timed_send(message) -> None:
            if message["type"] != "http.response.body" or not message.get("more_body"):
                return await send(message)
            try:
                await asyncio.wait_for(send(message), self.stream_timeout)
            except TimeoutError:
                abandon = scope.get(ABANDON)
                if abandon is not None:
                    abandon()
                self.metrics.timeouts.labels("stream").inc()
                raise ClientStalled(
                    f"the client read nothing for {self.stream_timeout:g} s (--stream-timeout): request cancelled"
                ) from None

        await self.app(scope, receive, timed_send)


async def _read_body(receive) -> list[dict]:
    """Every message of the request body (a disconnect ends it early)."""
    messages = []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request" or not message.get("more_body"):
            return messages


def _replay(messages: list[dict], receive):
    """A receive that gives the body already read, then the connection's own messages (a disconnect)."""
    pending = list(messages)

    async def replayed() -> dict:
        return pending.pop(0) if pending else await receive()

    return replayed


async def _request_timeout(send, seconds: float) -> None:
    """408 in OpenAI's error shape, closing the connection (the rest of the body is not read)."""
    body = schemas.error_body(
        f"the request body did not arrive within {seconds:g} s (--read-timeout)", type="invalid_request_error",
        code="request_timeout",
    )  # fmt: skip
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
               (b"connection", b"close")]  # fmt: skip
    await send({"type": "http.response.start", "status": 408, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
