"""Start `h2o-kv serve` as a child process on a free 127.0.0.1 port (the load generator's server)."""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

# the one-process server's uvicorn line, or the cluster's (`serve --replicas`)
_ADDRESS = re.compile(r"(?:Uvicorn running on|replica\(s\) ready at) http://127\.0\.0\.1:(\d+)")


def served_model(url: str) -> str:
    """The first model id a server lists at /v1/models."""
    response = httpx.get(f"{url}/v1/models", timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


@contextmanager
def launch_server(
    model: str, *, kv_memory: str | None, max_batch: int, prefill_chunk: int, kv_dtype: str | None = None,
    start_timeout: float = 600.0, extra: tuple[str, ...] = (),
) -> Iterator[str]:  # fmt: skip
    """Run `h2o-kv serve` until the block ends (then SIGTERM); yields its base URL. A SIGTERM to this process ends
    the block too (`_sigterm_unwinds`), so a study stopped by its PID stops the server it started."""
    with _sigterm_unwinds():
        yield from _serve(model, kv_memory=kv_memory, max_batch=max_batch, prefill_chunk=prefill_chunk,
                          kv_dtype=kv_dtype, start_timeout=start_timeout, extra=extra)  # fmt: skip


@contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """Inside the block, SIGTERM raises SystemExit(143) in the main thread (Python's default ends the process at once,
    running no `finally`), unless the process has a handler of its own or this is another thread."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def unwind(signum, frame) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, unwind)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _serve(model: str, *, kv_memory: str | None, max_batch: int, prefill_chunk: int, kv_dtype: str | None,
           start_timeout: float, extra: tuple[str, ...]) -> Iterator[str]:  # fmt: skip
    cmd = [sys.executable, "-m", "h2o_kv.cli", "serve", "--model", model, "--port", "0", "--log-level", "info",
           "--max-batch", str(max_batch), "--prefill-chunk", str(prefill_chunk), *extra]  # fmt: skip
    if kv_memory is not None:
        cmd += ["--kv-memory", str(kv_memory)]
    if kv_dtype is not None:
        cmd += ["--kv-dtype", kv_dtype]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=dict(os.environ))
    tail: collections.deque[str] = collections.deque(maxlen=40)
    port: list[int] = []

    def read() -> None:  # keep the pipe drained for the whole run (uvicorn logs every request)
        for line in proc.stderr:
            tail.append(line.rstrip())
            if not port and (match := _ADDRESS.search(line)):
                port.append(int(match.group(1)))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + start_timeout
    try:
        while not port:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("h2o-kv serve did not start:\n" + "\n".join(tail))
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port[0]}"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        reader.join(timeout=5)
