"""`free_port`: a TCP port on 127.0.0.1 to give a server another process starts (the cluster server in tests and
studies, torchrun in the tensor-parallel tests)."""

from __future__ import annotations

import random
import socket

PORTS_FROM = 20000  # free_port draws from here up: below are the well-known ports (Ray's 6379, 8265, 10001 among them)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for servers that cannot bind port 0 themselves (Ray Serve's proxy,
    torchrun's store). Drawn at random below the kernel's ephemeral range where there is room: a port of that range,
    free when drawn, is the kernel's to hand out again to any outgoing connection's source port or `bind(0)`, and a
    starting Ray makes hundreds of both before its proxy binds the port (without SO_REUSEADDR, so even a closed
    connection's TIME_WAIT holds it)."""
    low = _ephemeral_low()
    # the system's randomness, not `random`'s: two test workers that seeded `random` alike would draw alike
    draws = random.SystemRandom().sample(range(PORTS_FROM, low), 64) if low - PORTS_FROM >= 64 else []
    for port in draws:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use: the next draw
            return port
    with socket.socket() as sock:  # no room below the ephemeral range, or every draw in use: the kernel's pick
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out by itself (Linux's setting; elsewhere IANA's 49152)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except FileNotFoundError:
        return 49152
