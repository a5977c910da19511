"""allocator.py: glibc keeps freed memory, so a second large block reuses mapped pages instead of faulting.

The cases that set it run in their own process: mallopt changes the whole process.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from h2o_kv import allocator, cli

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt's parameters are glibc's")

# Allocate, touch and free a 256 MiB tensor twice; print the minor page faults of the second round.
SCRIPT = """
import resource, torch
from h2o_kv.allocator import retain_freed_memory
print(retain_freed_memory())
for _ in range(2):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = torch.ones(64 * 2**20)  # 256 MiB of float32, every page written
    del block
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(faults)
"""
PAGES = 256 * 2**20 // os.sysconf("SC_PAGE_SIZE")


def second_round(malloc: str) -> tuple[str, int]:
    env = dict(os.environ, H2O_KV_MALLOC=malloc)
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    state, faults = done.stdout.split()
    return state, int(faults)


@glibc
def test_retained_memory_is_reused_without_faults():
    state, faults = second_round("retained")
    assert state == "retained"
    assert faults < PAGES // 20, f"{faults} faults for {PAGES} pages: the freed block was not reused"


@glibc
def test_system_malloc_faults_every_page_again():
    state, faults = second_round("system")
    assert state == "system"
    assert faults > PAGES // 2, f"only {faults} faults for {PAGES} pages: glibc kept the block by itself"


def test_a_bad_setting_is_one_line_from_the_command(monkeypatch, capsys):
    monkeypatch.setattr(allocator, "_state", None)
    monkeypatch.setenv("H2O_KV_MALLOC", "jemalloc")
    assert cli.main(["generate", "hello", "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "h2o-kv: error: H2O_KV_MALLOC must be 'retained' or 'system', got 'jemalloc'"
