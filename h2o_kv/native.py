"""h2o-kv's C++ kernel (`csrc/int8_attend.cpp`): one decode step's attention over int8 keys and values on a CPU.

It is built on first use with torch's extension builder (ninja and a C++ compiler; about 15 s once, then
loaded from torch's extension cache, `TORCH_EXTENSIONS_DIR`), for this machine's vector width (torch's
`get_cpu_capability`: AVX-512 or AVX2), and registered as `torch.ops.h2o_kv.int8_attend_one`.
`KVCache(kv_dtype="int8")` uses it where it can be built (`missing()`); `compile_kernel=False` keeps the
eager path, `compile_kernel=True` requires the kernel.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "csrc" / "int8_attend.cpp"
_lock = threading.Lock()
_loaded = False


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

            build(name="h2o_kv_int8", sources=[str(SOURCE)], extra_cflags=flags(), is_python_module=False)
            _loaded = True


def flags() -> list[str]:
    """-O3 for this CPU, torch's OpenMP threads, and torch's vector classes at the width the CPU has."""
    options = ["-O3", "-march=native", "-fopenmp"]
    capability = torch.backends.cpu.get_cpu_capability()  # "AVX512", "AVX2", "DEFAULT", ...
    if capability in ("AVX512", "AVX2"):
        options += [f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}"]
    return options
