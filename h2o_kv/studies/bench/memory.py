"""Measuring memory: the cache's bytes from its tensors, its token counts, and a run's peak memory."""

from __future__ import annotations

import gc
import re
import resource
from pathlib import Path

import torch

from h2o_kv.cache.kvcache import KVCache
from h2o_kv.runtime.malloc import glibc
from h2o_kv.studies.bench.config import Cache


def kv_bytes(cache: Cache) -> tuple[int, int]:
    """(keys + values bytes, with int8 storage's scales; all cache bytes including slot bookkeeping)."""
    names = ("keys", "values", "key_scale", "value_scale")
    keys_values = sum(
        t.numel() * t.element_size()
        for layer in cache.layers
        for t in (getattr(layer, name, None) for name in names)
        if isinstance(t, torch.Tensor)
    )
    return keys_values, cache.nbytes() if isinstance(cache, KVCache) else keys_values


def kept_and_seen(cache: Cache, seen: int) -> tuple[int, int]:
    """(most tokens any head keeps, tokens that went through the cache). A stock cache keeps all
    `seen` tokens (a StaticCache's spare preallocated slots hold none)."""
    if isinstance(cache, KVCache):
        return cache.kept_tokens, cache.seen_tokens
    return seen, seen


class PeakMemory:
    """Peak memory of one region of the run, so each configuration is measured on its own.

    On CUDA: the allocator's peak, reset per region. On Linux CPUs: the kernel's resident-set
    high-water mark (VmHWM), reset per region through /proc/self/clear_refs after freed heap is
    returned to the OS. This isolates configurations without a process each: the peak of a
    long-lived process otherwise only grows. Where the reset is refused the lifetime peak is
    reported and `kind` says so ("rss-lifetime"). Both include everything allocated in the
    region (activations and attention temporaries, not only the cache).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.kind = "cuda" if device.type == "cuda" else "rss"
        self.base = 0

    def start(self) -> None:
        gc.collect()
        if self.kind == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            return
        _malloc_trim()
        try:
            Path("/proc/self/clear_refs").write_text("5")  # 5: reset the RSS high-water mark
        except OSError:
            self.kind = "rss-lifetime"
        self.base = _proc_status_kb("VmRSS") * 1024

    def stop(self) -> tuple[int, int]:
        """(peak bytes, peak bytes above what was resident at `start`)."""
        if self.kind == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            high_water = _proc_status_kb("VmHWM") * 1024
            peak = high_water or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return peak, max(0, peak - self.base)


def _proc_status_kb(field: str) -> int:
    """A field of /proc/self/status in kB; 0 where there is no /proc (not Linux)."""
    status = Path("/proc/self/status")
    if not status.is_file():
        return 0
    match = re.search(rf"^{field}:\s+(\d+)", status.read_text(), re.M)
    return int(match.group(1)) if match else 0


def _malloc_trim() -> None:
    """Hand freed heap back to the OS (glibc only), so the next region's RSS starts low."""
    libc = glibc()
    if libc is None:  # not glibc: nothing to trim, the RSS figures just start higher
        return
    libc.malloc_trim(0)
