"""The C++ kernels compile at both vector widths `native.flags` builds for, not only at this machine's.

`native.load` builds for the CPU it runs on (AVX-512 or AVX2); torch's vector headers differ between the two
(a source that compiled at AVX2 failed at AVX-512 for a missing include, found on a lent machine). The tests
build the other width's syntax here, so a machine of either kind checks both.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import sysconfig

import pytest
import torch

from h2o_kv.backends import native

COMPILER = os.environ.get("CXX", "c++")
ARCH = {"AVX512": "-march=skylake-avx512", "AVX2": "-march=haswell"}

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or shutil.which(COMPILER) is None,
    reason="needs an x86-64 machine with a C++ compiler",
)


def _command(capability: str, source) -> list[str]:
    from torch.utils.cpp_extension import include_paths

    includes = [arg for path in [*include_paths(), sysconfig.get_paths()["include"]] for arg in ("-isystem", path)]
    defines = [*native.vector_defines(capability), "-DTORCH_API_INCLUDE_EXTENSION_H"]
    return [COMPILER, "-fsyntax-only", "-std=c++17", "-fopenmp", ARCH[capability], *defines, *includes, str(source)]


def test_the_kernels_compile_at_the_width_this_machine_does_not_build(tmp_path):
    """The sources as one translation unit (torch's headers, most of the time, parsed once, not once per source):
    a compiler error still names the source file and line."""
    built = torch.backends.cpu.get_cpu_capability()
    other = "AVX2" if built == "AVX512" else "AVX512"
    unit = tmp_path / "kernels_at_the_other_width.cpp"
    unit.write_text("".join(f'#include "{source}"\n' for source in native.SOURCES))
    done = subprocess.run(_command(other, unit), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{other} build of {[s.name for s in native.SOURCES]}:\n" + done.stderr[:4000]


@pytest.mark.skipif(native.missing() is not None, reason="the kernels cannot be built here")
def test_a_build_killed_half_way_does_not_hang_the_next_process(tmp_path):
    """torch's builder leaves its `lock` file when a build is killed (Ctrl-C, a timeout); the next process
    would wait for it forever. `native.load` clears it under its own OS lock and loads. Done on a copy of the
    built folder, so no other test process loading the kernels meets the planted `lock` file."""
    native.load()  # built (or loaded) here first, so the process below only loads
    folder = tmp_path / native.build_folder().name
    shutil.copytree(native.build_folder(), folder, ignore=shutil.ignore_patterns("lock", "h2o-kv.lock"))
    (folder / "lock").touch()  # what a killed build leaves
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", "from h2o_kv.backends import native; native.load(); print('loaded')"],
                          capture_output=True, text=True, timeout=240, env=env)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "loaded", done.stderr[-2000:]
    assert not (folder / "lock").exists()
