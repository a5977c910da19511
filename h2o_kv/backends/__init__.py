"""Where a layer's attention over its slots runs, beside the pure-torch routes of `h2o_kv.cache.attend`.

- `triton_decode` / `triton_scores`: Triton kernels for GPUs (a decode step's attention with the policy's
  per-slot probabilities; a prompt's per-key probabilities after flash attention). They also run on CPU
  tensors under `TRITON_INTERPRET=1`, which is how CI tests them.
- the C++ kernels for CPUs live in `h2o_kv.backends.native` (to move here with the package layout).

`use_triton(device)` is the one decision of whether the Triton kernels run for tensors on a device;
`h2o_kv.cache.routes` says which kernel runs each call. `prepare(device)` builds or loads, ahead of the first
step, what a cache on a device runs by default.
"""

from __future__ import annotations

import importlib.util
import os

import torch

_TRITON = importlib.util.find_spec("triton") is not None


def triton_importable() -> bool:
    """Whether Triton is installed (it comes with torch's CUDA builds; the dev extra has it for the CPU tests)."""
    return _TRITON


def interpreted() -> bool:
    """Whether Triton runs its kernels in its CPU interpreter (`TRITON_INTERPRET=1`: the tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(device: torch.device) -> bool:
    """Whether the Triton kernels run for tensors on `device`: on CUDA where Triton imports (`H2O_KV_TRITON=0`
    turns them off); on a CPU only under the interpreter and when asked for (`H2O_KV_TRITON=1`: the tests)."""
    choice = os.environ.get("H2O_KV_TRITON")
    if choice == "0" or not triton_importable():
        return False
    return device.type == "cuda" or (device.type == "cpu" and interpreted() and choice == "1")


def prepare(device: torch.device) -> None:
    """Build (once per machine) or load the kernels a cache on `device` runs by default (`compile_kernel=None`),
    before its first step needs them: h2o-kv's C++ kernels on a CPU where they can be built; nothing elsewhere."""
    from h2o_kv.backends import native

    if device.type == "cpu" and native.resolve(None):
        native.load()
