"""Keep freed memory in the process instead of handing it back to the OS page by page (glibc only).

glibc serves every allocation above its mmap threshold (at most 32 MiB) with fresh pages from the OS and
unmaps them when freed. A long prompt's activations are far above that, so every layer of every prefill
touches new pages, and each first touch is a page fault (docs/performance.md has the counts). Decode steps
allocate little and fault almost never.

`retain_freed_memory()` asks glibc (mallopt) to serve large blocks from its heap too and to keep the
heap's freed top, so the next prompt reuses pages already mapped: what jemalloc and tcmalloc, which
PyTorch's CPU performance guides preload, do by default. The resident size then stays at its high-water
mark rather than falling between prompts, and a prompt's peak is higher (the heap grows once more before freed
blocks fit again). It is
process-wide, so the library never calls it on import; the `h2o-kv` command does at its start, for every
subcommand (generate, serve, eval, bench), unless the environment sets `H2O_KV_MALLOC=system`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
KEEP_BYTES = 2**31 - 1  # the trim threshold is an int: keep up to 2 GiB of freed heap top (more is kept in the heap)

_state: str | None = None


def retain_freed_memory() -> str:
    """Set glibc to keep freed memory (see the module docstring) once per process; returns what the process
    runs with: "retained", "system" (H2O_KV_MALLOC=system, or not glibc: nothing changed)."""
    global _state
    if _state is not None:
        return _state
    choice = os.environ.get("H2O_KV_MALLOC", "retained").strip().lower()
    if choice not in ("retained", "system"):
        raise ValueError(f"H2O_KV_MALLOC must be 'retained' or 'system', got {choice!r}")
    libc = glibc() if choice == "retained" else None
    if libc is None:
        _state = "system"
        return _state
    if not (libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, KEEP_BYTES)):
        raise OSError("glibc refused mallopt(M_MMAP_MAX / M_TRIM_THRESHOLD); set H2O_KV_MALLOC=system")
    _state = "retained"
    return _state


def malloc_state() -> str:
    """What this process runs with, for a report: "retained" once `retain_freed_memory` ran, else "system"."""
    return _state or "system"


def glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (mallopt's parameters above, malloc_trim), else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc
