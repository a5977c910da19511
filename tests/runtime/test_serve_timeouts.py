"""`h2o-kv serve`'s client timeouts (timeouts.py): headers or a body sent too slowly end the connection (the body
with a 408), a stream left unread is cancelled; each is counted in /metrics and leaves no KV bytes in use."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

pytest.importorskip("fastapi")

import httpx  # noqa: E402

from h2o_kv.runtime.engine import Engine  # noqa: E402
from h2o_kv.runtime.serve.app import create_app  # noqa: E402
from h2o_kv.runtime.serve.requests import Limits  # noqa: E402
from h2o_kv.runtime.serve.server import serve_in_thread  # noqa: E402
from h2o_kv.runtime.serve.timeouts import ClientStalled  # noqa: E402

from serve_helpers import MODEL, metric, tiny_model, wait_for  # noqa: E402

LIMITS = Limits(read_timeout=0.5, stream_timeout=0.5, max_new_tokens=400)


@pytest.fixture(scope="module")
def served(model, tokenizer):
    engine = Engine(model, tokenizer, max_batch=2)
    with serve_in_thread(create_app(engine, MODEL, limits=LIMITS), engine) as url:
        yield engine, url


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _read_until_closed(sock: socket.socket, limit: float = 10.0) -> bytes:
    """Everything the server sends until it closes the connection (at most `limit` seconds)."""
    data, deadline = b"", time.monotonic() + limit
    while time.monotonic() < deadline:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    raise AssertionError(f"the server kept the connection open for {limit} s")


def test_the_timeouts_are_in_the_metrics(served):
    _, url = served
    assert metric(url, "h2o_kv_request_limit", {"limit": "read_timeout"}) == 0.5
    assert metric(url, "h2o_kv_request_limit", {"limit": "stream_timeout"}) == 0.5


def test_headers_sent_too_slowly_close_the_connection(served):
    engine, url = served
    before = metric(url, "h2o_kv_client_timeouts_total", {"kind": "header"})
    with _connect(url) as sock:
        start = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and no more
        assert _read_until_closed(sock) == b""
        assert 0.4 < time.monotonic() - start < 5
    assert metric(url, "h2o_kv_client_timeouts_total", {"kind": "header"}) == before + 1
    assert engine.kv_bytes_in_use() == 0


def test_a_body_sent_too_slowly_gets_408_and_the_connection_closed(served):
    engine, url = served
    before = metric(url, "h2o_kv_client_timeouts_total", {"kind": "body"})
    body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 4}).encode()
    with _connect(url) as sock:
        head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body[:10])  # the rest never comes
        reply = _read_until_closed(sock)
    status, _, rest = reply.partition(b"\r\n")
    assert status == b"HTTP/1.1 408 Request Timeout"
    assert json.loads(rest.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"
    assert metric(url, "h2o_kv_client_timeouts_total", {"kind": "body"}) == before + 1
    assert engine.stats()["running"] == 0 and engine.kv_bytes_in_use() == 0
    fine = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 3}, timeout=60)
    assert fine.status_code == 200  # a client that sends in time is served as before


def test_a_stream_left_unread_is_cancelled_and_frees_its_kv(tokenizer):
    """The client reads the first chunk and stops: the next write blocks (here: never returns, as on a socket
    whose buffers are full), and after stream_timeout the request is cancelled and the connection ended, long
    before its 8,000 tokens could be generated."""
    engine = Engine(tiny_model(tokenizer, context=8192), tokenizer, max_batch=2)
    limits = Limits(stream_timeout=0.3, max_new_tokens=8000)
    app = create_app(engine, MODEL, limits=limits, manage_engine=False)
    body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 8000, "stream": True, "ignore_eos": True})
    headers = [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]  # fmt: skip
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": headers, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}  # fmt: skip

    async def run() -> list[dict]:
        incoming = [{"type": "http.request", "body": body.encode(), "more_body": False}]
        never = asyncio.Event()
        sent: list[dict] = []

        async def receive() -> dict:
            if incoming:
                return incoming.pop(0)
            await never.wait()  # the client neither sends nor disconnects
            raise AssertionError("unreachable")

        async def send(message: dict) -> None:
            if sum(m["type"] == "http.response.body" for m in sent) >= 1 and message["type"] == "http.response.body":
                await never.wait()  # the client stopped reading after the first chunk
            sent.append(message)

        with pytest.raises(ClientStalled):
            await asyncio.wait_for(app(scope, receive, send), 30)
        return sent

    engine.start()
    try:
        start = time.monotonic()
        sent = asyncio.run(run())
        assert time.monotonic() - start < 20
        assert sent[0]["status"] == 200 and sent[1]["body"].startswith(b"data: ")
        wait_for(lambda: engine.stats()["running"] == 0, timeout=10, what="the request cancelled")
        assert engine.kv_bytes_in_use() == 0
        assert engine.stats()["generated_tokens"] < 8000  # cancelled, not run to its end
        metrics = app.state.metrics.render().decode()
        assert 'h2o_kv_client_timeouts_total{kind="stream"} 1.0' in metrics
        assert 'h2o_kv_requests_total{finish_reason="cancelled"} 1.0' in metrics
    finally:
        engine.shutdown(drain=False)


def test_a_stream_left_unread_over_a_socket_is_cancelled(tokenizer):
    """The same over a real connection: the client never reads; once the server's bounded send buffer (64 KiB)
    and the client's are full, writes block, and stream_timeout later the request is cancelled."""
    engine = Engine(tiny_model(tokenizer, context=8192), tokenizer, max_batch=2)
    app = create_app(engine, MODEL, limits=Limits(stream_timeout=0.5, max_new_tokens=8000))
    body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 8000, "stream": True, "ignore_eos": True})
    with serve_in_thread(app, engine) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
            sock.connect((host, int(port)))
            head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n{body}".encode())
            wait_for(lambda: metric(url, "h2o_kv_client_timeouts_total", {"kind": "stream"}) == 1, timeout=30,
                     what="the unread stream timed out")  # fmt: skip
            wait_for(lambda: engine.stats()["running"] == 0, timeout=10, what="the request cancelled")
            assert engine.kv_bytes_in_use() == 0
            assert engine.stats()["generated_tokens"] < 8000
            assert metric(url, "h2o_kv_requests_total", {"finish_reason": "cancelled"}) == 1
