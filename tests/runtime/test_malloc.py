"""malloc.py: glibc keeps freed memory, so later large blocks reuse mapped pages instead of faulting.

The cases that set it run in their own process: mallopt changes the whole process.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from h2o_kv import cli
from h2o_kv.runtime import malloc

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt's parameters are glibc's")

# Allocate, touch and free a 256 MiB tensor five times; print the minor page faults of rounds 2-5. Small
# objects made between rounds can take the start of the freed block, so the heap may grow once more before
# the blocks reuse it: retained, about one round's pages in all; glibc as it comes, every round's. The process
# first imports what a command has imported by its first prompt (transformers): a heap with free small chunks,
# which later small objects take, rather than a bare one whose only free chunk is the big block (split by every
# small object, so the heap grew every round in a bare process on a busy machine).
SCRIPT = """
import resource, torch, transformers
from h2o_kv.runtime.malloc import retain_freed_memory
print(retain_freed_memory())
faults = []
for _ in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = torch.ones(64 * 2**20)  # 256 MiB of float32, every page written
    del block
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults[1:]))
"""
PAGES = 256 * 2**20 // os.sysconf("SC_PAGE_SIZE")


def later_rounds(setting: str) -> tuple[str, int]:
    env = dict(os.environ, H2O_KV_MALLOC=setting)
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    state, faults = done.stdout.split()
    return state, int(faults)


@glibc
def test_retained_memory_is_reused_without_faults():
    state, faults = later_rounds("retained")
    assert state == "retained"
    assert faults < 2 * PAGES, f"{faults} faults in four rounds of {PAGES} pages: the freed blocks were not reused"


@glibc
def test_system_malloc_faults_every_page_again():
    state, faults = later_rounds("system")
    assert state == "system"
    assert faults > 3 * PAGES, f"only {faults} faults in four rounds of {PAGES} pages: glibc kept the blocks"


def test_a_bad_setting_is_one_line_from_the_command(monkeypatch, capsys):
    monkeypatch.setattr(malloc, "_state", None)
    monkeypatch.setenv("H2O_KV_MALLOC", "jemalloc")
    assert cli.main(["generate", "hello", "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "h2o-kv: error: H2O_KV_MALLOC must be 'retained' or 'system', got 'jemalloc'"
