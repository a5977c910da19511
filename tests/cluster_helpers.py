"""`h2o-kv serve --replicas N` as a process for tests (tests/runtime/test_cluster.py), and its processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

from h2o_kv.runtime.ports import free_port

from serve_helpers import wait_for


@dataclass
class Server:
    """A cluster server process and what it printed so far."""

    url: str
    proc: subprocess.Popen
    out: list[str]
    reader: threading.Thread  # reads `out` from the process, ends with it
    temp_dir: str  # its private Ray's files
    ray_address: str  # its private Ray's GCS address


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE  # a zombie has ended, only not reaped
    except psutil.NoSuchProcess:
        return False


def carrying(text: str) -> list[psutil.Process]:
    """Live processes whose command line contains `text`."""
    found = []
    for proc in psutil.process_iter():
        try:
            if any(text in part for part in proc.cmdline()) and alive(proc):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


@contextmanager
def cluster_server(model: Path, flags: list[str]) -> Iterator[Server]:
    """`h2o-kv serve --model MODEL FLAGS` on a free 127.0.0.1 port (one OpenMP thread), once it prints its ready line.
    On exit, if it still runs: SIGTERM (it drains and stops), SIGKILL after 3 minutes; then any process of its Ray
    still there is killed, so a failed test leaves none."""
    port = free_port()
    cmd = [sys.executable, "-m", "h2o_kv.cli", "serve", "--model", str(model), "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=os.environ | {"OMP_NUM_THREADS": "1"})  # fmt: skip
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(line.rstrip() for line in proc.stdout), daemon=True)
    reader.start()
    temp_dir = ""
    try:
        wait_for(lambda: proc.poll() is not None or any("replica(s) ready at" in line for line in out), timeout=600,
                 what="the cluster server's ready line")  # fmt: skip
        assert proc.poll() is None, "\n".join(out)
        (line,) = [line for line in out if "its files in " in line]
        address, temp_dir = line.split("a private Ray at ")[1].split(", its files in ")
        temp_dir = temp_dir.split()[0]
        yield Server(f"http://127.0.0.1:{port}", proc, out, reader, temp_dir, address)
    finally:
        started = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=180)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=60)
        for leftover in [p for p in started + (carrying(temp_dir) if temp_dir else []) if alive(p)]:
            leftover.kill()
        reader.join(timeout=30)
