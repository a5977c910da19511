"""h2o-kv's C++ kernels (`csrc/attend_one.cpp`): a decode step's attention on a CPU where torch's products
do more work than needed.

- `int8_attend_one`: over int8 keys and values (quant.py). Torch has no int8 x float product on a CPU; the
  eager path widens a layer's storage to float and multiplies with MKL, this kernel widens one (sequence,
  KV head) row at a time inside the core's cache.
- `pooled_attend_one`: over a head-pooled row (pooled.py, AdaKV). The eager path computes every query
  head against every slot of the row and masks the other heads' slots (3x the products of a uniform
  layer on SmolLM2); this kernel computes each query head against its own head's slots only.

They are built at the first decode step that needs them on a CPU, with torch's extension builder (ninja
and a C++ compiler; about 15 s once per machine, then loaded from torch's extension cache,
`TORCH_EXTENSIONS_DIR`), for this machine's vector width (torch's `get_cpu_capability`: AVX-512 or AVX2),
and registered as `torch.ops.h2o_kv.*`. `KVCache` uses them where they can be built (`missing()`);
`compile_kernel=False` keeps the eager path, `compile_kernel=True` requires them.
"""

from __future__ import annotations

import functools
import os
import shutil
import threading
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "csrc" / "attend_one.cpp"
_lock = threading.Lock()
_loaded = False


@functools.cache  # a cache per request (the engine) asks again; ninja's check runs a process
def missing() -> str | None:
    """Why the kernel cannot be built on this machine, or None when it can."""
    from torch.utils.cpp_extension import is_ninja_available

    if not is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler {compiler!r} on PATH"
    return None


def load() -> None:
    """Build (once per machine) and load (once per process) the kernel; build errors are raised as they come."""
    global _loaded
    if _loaded:
        return
    with _lock:
        if not _loaded:
            from torch.utils.cpp_extension import load as build

            build(name="h2o_kv_kernels", sources=[str(SOURCE)], extra_cflags=flags(), is_python_module=False)
            _loaded = True


def flags() -> list[str]:
    """-O3 for this CPU, torch's OpenMP threads, and torch's vector classes at the width the CPU has."""
    options = ["-O3", "-march=native", "-fopenmp"]
    capability = torch.backends.cpu.get_cpu_capability()  # "AVX512", "AVX2", "DEFAULT", ...
    if capability in ("AVX512", "AVX2"):
        options += [f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}"]
    return options


def int8_attend_one(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_scale: torch.Tensor,
    value_scale: torch.Tensor,
    pos: torch.Tensor | None,
    *,
    scaling: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`kernel.attend_one` over int8 storage: q [B, Hq, 1, D], keys/values [B, H, S, D] int8 with their scales
    [B, H, S], pos [B, H, S] (-1 = empty slot; None: every slot holds a token, nothing masked); the output
    [B, 1, Hq, D] float32, scores and last [B, H, S]."""
    load()
    batch, q_heads, _, dim = q.shape
    query = (q.float() * scaling).reshape(batch, q_heads, dim)
    cap = 0.0 if softcap is None else softcap
    out, scores, last = torch.ops.h2o_kv.int8_attend_one(query, keys, values, key_scale, value_scale, pos, cap)
    return out.view(batch, 1, q_heads, dim), scores, last


def pooled_attend_one(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slot_head: torch.Tensor,
    pos: torch.Tensor,
    heads: int,
    *,
    scaling: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`kernel.attend_one` over a head-pooled row: q [B, Hq, 1, D] float32 (query head i reads KV head
    i // (Hq / heads)), keys/values [B, 1, S, D] float32, slot_head [B, 1, S] int8, pos [B, 1, S]; the output
    [B, 1, Hq, D], scores [B, 1, S] (summed over each slot's own query heads) and last (their mean)."""
    load()
    batch, q_heads, _, dim = q.shape
    query = (q * scaling).reshape(batch, q_heads, dim)
    cap = 0.0 if softcap is None else softcap
    out, scores, last = torch.ops.h2o_kv.pooled_attend_one(query, keys, values, slot_head, pos, heads, cap)
    return out.view(batch, 1, q_heads, dim), scores, last
