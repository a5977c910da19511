"""One replica of `h2o-kv serve --replicas N`: an h2o-kv engine with its own bounded KV memory, behind the same
OpenAI app as the one-process server (`serve.app.create_app`), called in process.

The gateway (gateway.py) hands each HTTP request over as (method, path, headers, body); `forward` runs it
through the replica's app and yields the response's start (status and headers) and then its body chunks,
as the app sends them, so a stream stays a stream across the cluster. A cancelled call (the client went
away, or the gateway gave up) is a disconnect for the app, which cancels the request and frees its rows.
`record_routing_stats` is what Ray Serve polls for the router (routing.py): the replica's room for more KV, and
the (length, fingerprint) of each sequence its prefix store keeps (affinity.py).
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import AsyncIterator

from h2o_kv.runtime.cluster.affinity import BEAT_S


class EngineReplica:
    """A Ray Serve deployment class (made one by `gateway.build`): an engine and its app."""

    def __init__(self, model: str, device: str, engine: dict, served_name: str, limits) -> None:
        from h2o_kv.runtime.engine import Engine
        from h2o_kv.runtime.models import load_model
        from h2o_kv.runtime.serve.app import create_app

        loaded, tokenizer = load_model(model, device=device)
        self.engine = Engine(loaded, tokenizer, **engine)
        self.engine.start()
        self.app = create_app(self.engine, served_name, limits=limits, manage_engine=False)

    def record_routing_stats(self) -> dict:
        """The replica's admission state for the router: KV bytes free for new reservations (allowed minus
        reserved; +inf without a limit), requests waiting and running, its batch slots, the (length, fingerprint)
        of its kept sequences (newest first), the process id and torch's threads. `beat` changes every `BEAT_S`:
        Ray Serve passes a report on only when it differs from the last, and the router must hear from an idle
        replica too, to tell it from a stuck one."""
        import torch

        stats = self.engine.stats()
        allowed = stats["kv_bytes_allowed"]
        free = math.inf if allowed is None else allowed - stats["kv_bytes_reserved"]
        kept = () if self.engine.prefixes is None else self.engine.prefixes.kept  # a snapshot, read without locks
        return {**stats, "free_kv_bytes": free, "max_batch": self.engine.max_batch, "kept": kept,
                "beat": int(time.monotonic() // BEAT_S), "pid": os.getpid(),
                "torch_threads": torch.get_num_threads()}  # fmt: skip

    async def forward(self, method: str, path: str, headers: list, body: bytes, prompt=None) -> AsyncIterator:
        """Run one HTTP request through the app: yields {"status", "headers"} and then each body chunk. `prompt`
        (the prompt's fingerprints, affinity.Prompt) is for the router, which reads it from the call."""
        sent: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        incoming = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict:
            if incoming:
                return incoming.pop()
            await gone.wait()
            return {"type": "http.disconnect"}

        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "client": ("gateway", 0),
            "server": ("replica", 0), "headers": [(bytes(k), bytes(v)) for k, v in headers],
        }  # fmt: skip
        app = asyncio.create_task(self.app(scope, receive, sent.put))
        try:
            while True:
                getter = asyncio.ensure_future(sent.get())
                await asyncio.wait({getter, app}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():  # the app ended without sending more: its error surfaces here
                    getter.cancel()
                    app.result()
                    raise RuntimeError("the replica's app returned without completing its response")
                message = getter.result()
                if message["type"] == "http.response.start":
                    yield {"status": message["status"], "headers": list(message.get("headers", []))}
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body"):
                        return
        finally:
            gone.set()  # a disconnect for the app: a request still running is cancelled
            await asyncio.wait({app}, timeout=5)
