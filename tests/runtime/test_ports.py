"""free_port (runtime/ports.py): a port outside the kernel's ephemeral range, so the processes a starting Ray runs
cannot take it (as a connection's source port or by `bind(0)`) before the server that was given it binds it:
tests/runtime/test_cluster.py's server once failed to start on such a port."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from h2o_kv.runtime.ports import PORTS_FROM, free_port

RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def test_free_ports_are_drawn_below_the_ephemeral_range_and_bind():
    if not RANGE.exists():
        pytest.skip("no Linux ephemeral port range to read")
    low = int(RANGE.read_text().split()[0])
    if low - PORTS_FROM < 64:
        pytest.skip(f"this kernel hands out ports from {low}: no room below its range")
    ports = [free_port() for _ in range(20)]
    assert all(PORTS_FROM <= port < low for port in ports), (low, ports)
    assert len(set(ports)) > 1, ports  # drawn at random, not the same port each call
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free now, as it was when drawn (no SO_REUSEADDR: as Ray's proxy binds)
