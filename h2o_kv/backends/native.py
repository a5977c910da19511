"""h2o-kv's C++ kernels (`csrc/`): the parts of a decode step on a CPU where torch's products do more work,
or read memory slower, than needed.

- `attend_one`: a decode step's attention over float32, bfloat16 or int8 keys and values (quant.py), one (sequence,
  KV head) row at a time inside the core's cache, in one pass (the eager path runs several small batched
  products over the layer). Torch has no int8 x float product on a CPU; the eager path widens a layer's
  int8 storage to float and multiplies with MKL, this kernel widens int8 (and bfloat16) in registers as it
  reads it and multiplies in float32.
- `decode_step` (in `csrc/attend_one.cpp`): a full layer's whole decode step (steady.py) in the same pass per
  row: the new token written into the slot the last step freed, the attention, the scores, and the eviction
  of the oldest lowest priority for a policy ranking by score with the newest kept (`Policy.protected_recent`:
  H2O, SnapKV), in place of about fifteen small torch operations and their Python per layer.
- `pooled_attend_one` (`csrc/pooled_attend.cpp`): over a head-pooled row (pooled.py, AdaKV). The eager
  path computes every query head against every slot of the row and masks the other heads' slots (3x the
  products of a uniform layer on SmolLM2); this kernel computes each query head against its own head's
  slots only, reading the row once in the order it lies in memory; and `lowest_slots`, the slots such a row
  frees at a decode step (one pass in place of torch's topk, sort and compare); `pooled_decode_step`, a full
  head-pooled layer's whole decode step as `decode_step` is a uniform layer's.
- `prompt_attend` (`csrc/prompt_attend.cpp`): a prompt's attention with every query's probabilities summed per slot
  (H2O's scores), per (sequence, KV head) on tiles of queries inside the core's cache; the blocked torch path's
  batched products at its shapes run at about half SDPA's speed.

They are built at the first prompt or decode step that needs them on a CPU, with torch's extension builder (ninja
and a C++ compiler; once per source version and machine, then loaded from torch's extension cache,
`TORCH_EXTENSIONS_DIR`, `build_folder`), for this machine's vector width (torch's `get_cpu_capability`: AVX-512
or AVX2), and registered as `torch.ops.h2o_kv.*`. `KVCache` takes `compile_kernel` (`resolve`): None uses them
where they can be built (`missing()`), False keeps torch's path, True requires them.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

SOURCES = [
    Path(__file__).parent / "csrc" / name for name in ("attend_one.cpp", "pooled_attend.cpp", "prompt_attend.cpp")
]
HEADERS = [Path(__file__).parent / "csrc" / "kernels.h"]
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


def resolve(compile_kernel: bool | None) -> bool:
    """Whether to use the kernels: None where they can be built, True always (an error where they cannot),
    False never. Callers build or load them (`load`) only when a CPU step first needs one (a cache's first
    prompt or decode step, the engine's start), so a cache on a GPU never builds them."""
    if compile_kernel is not None and not isinstance(compile_kernel, bool):
        raise TypeError(f"compile_kernel must be None, True or False, got {compile_kernel!r}")
    if compile_kernel is False:
        return False
    reason = missing()
    if reason is not None and compile_kernel:
        raise RuntimeError(f"compile_kernel=True, but h2o-kv's C++ kernels cannot be built here: {reason}")
    return reason is None


BUILD_SECONDS = "about 30 s on one core"  # measured: docs/usage.md


def load() -> None:
    """Build (once per source version and machine) and load (once per process) the kernels; build errors are
    raised as they come. A build, or a wait for another process's build, says so on stderr, with a heartbeat."""
    global _loaded
    if _loaded:
        return
    with _lock:
        if not _loaded:
            from torch.utils.cpp_extension import load as build

            folder = build_folder()
            with _build_lock(folder):
                sources = _copy_sources(folder)
                with _heartbeat(None if (folder / "h2o_kv_kernels.so").exists() else "building h2o-kv's C++ kernels "
                                f"in {folder}, once for these sources ({BUILD_SECONDS})"):  # fmt: skip
                    build(name="h2o_kv_kernels", sources=sources, extra_cflags=flags(), is_python_module=False,
                          build_directory=str(folder))  # fmt: skip
            _loaded = True


def build_folder() -> Path:
    """Where the kernels are built: under `TORCH_EXTENSIONS_DIR` (torch's extension cache by default), one folder
    per Python and torch version and per digest of the sources, headers and flags, so two checkouts with the same
    kernels share a build and never rebuild each other's."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    return Path(root) / f"h2o_kv_kernels-{python}-torch{torch.__version__}-{digest()}"


def digest() -> str:
    """The first 12 hex digits of the SHA-256 of the sources, the headers, the unit compiled and the flags."""
    parts = [path.read_bytes() for path in SOURCES + HEADERS] + [_unit(), " ".join(flags()).encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:12]


def _copy_sources(folder: Path) -> list[str]:
    """The sources and headers copied into the build folder, and the one source the build compiles there: a unit
    that includes the others, so torch's headers (about half of a source's compile) are parsed once, not once per
    source (27 s of one core in place of 57). The build then names the same files whichever checkout asks for it
    (torch rebuilds when a source's path changes); a compiler error still names the source file and line."""
    (folder / "src").mkdir(exist_ok=True)
    for path in SOURCES + HEADERS:
        _write(folder / "src" / path.name, path.read_bytes())
    unit = folder / "src" / "h2o_kv_kernels.cpp"
    _write(unit, _unit())
    return [str(unit)]


def _unit() -> bytes:
    """The one source the build compiles: the sources, included in order."""
    return "".join(f'#include "{path.name}"\n' for path in SOURCES).encode()


def _write(path: Path, content: bytes) -> None:
    """Write `content` unless the file holds it already (its time stamp then stays: ninja rebuilds nothing)."""
    if not path.exists() or path.read_bytes() != content:
        path.write_bytes(content)


@contextlib.contextmanager
def _heartbeat(
    message: str | None, doing: str = "building", done: str = "built", every: float = 15.0
) -> Iterator[None]:
    """`message` on stderr, then a line every `every` seconds until the block ends, and one at its end (None:
    silence)."""
    if message is None:
        yield
        return
    print(f"h2o-kv: {message}", file=sys.stderr, flush=True)
    stop, start = threading.Event(), time.monotonic()

    def beat() -> None:
        while not stop.wait(every):
            print(f"h2o-kv: still {doing} ({time.monotonic() - start:.0f} s)", file=sys.stderr, flush=True)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        print(f"h2o-kv: {done} in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _build_lock(folder: Path) -> Iterator[None]:
    """One h2o-kv build or load at a time per folder, by an OS file lock the system frees if its process dies;
    a process that finds it held says it waits, with a heartbeat.

    torch's builder guards a folder with a `lock` file that only a finished build removes: a build killed
    half-way (Ctrl-C, a timeout) leaves it, and every later process waits for it forever, silently. While this
    lock is held no other h2o-kv process is in the folder, so a `lock` file found there is such a leftover and
    is removed. Without POSIX file locks (Windows) torch's own guard is all there is.
    """
    folder.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(folder / "h2o-kv.lock", "a") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another process builds or loads: wait for it, and say so
            with _heartbeat(f"waiting for another process building the C++ kernels in {folder}", "waiting",
                            "the other process finished"):  # fmt: skip
                fcntl.flock(held, fcntl.LOCK_EX)  # freed when that process exits, however it exits
        (folder / "lock").unlink(missing_ok=True)
        yield


def flags() -> list[str]:
    """-O3 for this CPU, torch's OpenMP threads, and torch's vector classes at the width the CPU has."""
    return ["-O3", "-march=native", "-fopenmp", *vector_defines(torch.backends.cpu.get_cpu_capability())]


def vector_defines(capability: str) -> list[str]:
    """The defines selecting torch's vector classes for `capability` ("AVX512", "AVX2"; others: none, the
    headers' default width)."""
    if capability in ("AVX512", "AVX2"):
        return [f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}"]
    return []


def attend_one(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    pos: torch.Tensor | None,
    *,
    scaling: float,
    softcap: float | None = None,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`attend.attend_one` in one pass per (sequence, KV head): q [B, Hq, 1, D] float32, keys/values
    [B, H, S, D] float32 or bfloat16, or int8 with their scales [B, H, S] (quant.py), pos [B, H, S] (-1 = empty slot;
    None: every slot holds a token, nothing masked); the output [B, 1, Hq, D] float32, scores and last [B, H, S]."""

    def run(query: torch.Tensor, cap: float):  # after `load`: the op exists once the kernels are loaded
        return torch.ops.h2o_kv.attend_one(query, keys, values, key_scale, value_scale, pos, cap)

    return _one_query(q, scaling, softcap, run)


def _one_query(q: torch.Tensor, scaling: float, softcap: float | None, run) -> tuple[torch.Tensor, ...]:
    """A decode step's kernel call: the kernels loaded, q [B, Hq, 1, D] scaled and flattened to [B, Hq, D] in
    float32, `run(query, softcap or 0)`; its output back as [B, 1, Hq, D] with the rest of what it returns."""
    load()
    batch, q_heads, _, dim = q.shape
    out, *rest = run((q.float() * scaling).reshape(batch, q_heads, dim), 0.0 if softcap is None else softcap)
    return out.view(batch, 1, q_heads, -1), *rest


def decode_step(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    pos: torch.Tensor,
    score: torch.Tensor,
    last: torch.Tensor | None,
    slot: torch.Tensor,
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
    qpos: torch.Tensor,
    recent: torch.Tensor,
    capacity: torch.Tensor,
    *,
    scaling: float,
    softcap: float | None = None,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    new_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A uniform layer's steady decode step, one pass per (sequence, KV head) (`steady.Steady._decode_fused`),
    in place on the layer's storage: keys/values [B, H, S, D] (float32, bfloat16, or int8 with key_scale/value_scale
    [B, H, S]), pos, score and last [B, H, S]. The new token (new_keys/new_values [B, H, 1, D] in the storage's
    dtype, int8 with `new_scales` [B, H, 1] each) goes into the empty slot [B, H, 1] at positions qpos [B, 1];
    the query q [B, Hq, 1, D] attends over the row, the scores grow, and each row frees the oldest of its lowest
    priorities: its score, +inf for the `recent` [B, 1, 1] newest positions (`Policy.protected_recent`) and for
    positions below `sinks` [B, 1, 1] (`Policy.protected_sinks`; None: none), an empty slot first within
    `capacity` [B, 1] and never over it. Returns the output [B, 1, Hq, D] (float32) and the
    freed slots [B, H, 1]. The query's scaling and the reshapes happen inside the C++ call (five Python tensor
    operations a layer fewer)."""
    load()
    new_key_scale, new_value_scale = (None, None) if new_scales is None else new_scales
    out, freed = torch.ops.h2o_kv.decode_step(
        q, keys, values, key_scale, value_scale, pos, score, last, slot, new_keys, new_values, new_key_scale,
        new_value_scale, qpos, recent, capacity, scaling, 0.0 if softcap is None else softcap, sinks,
    )  # fmt: skip
    return out, freed


def prompt_attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    pos: torch.Tensor,
    qpos: torch.Tensor,
    *,
    has_padding: bool,
    new_from: int,
    scaling: float,
    want_scores: bool,
    score_from: int,
    want_last: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`routes.attend`'s `native_prompt` route: new tokens in order in slots new_from .. new_from + n - 1, without
    window or softcap: q [B, Hq, n, D], keys/values [B, H, S, D] float32, pos [B, H, S] (an old slot with pos < 0 is
    empty), qpos [B, n] (read with `has_padding`: query i sees the slots at positions 0 .. qpos[i], none at -1).
    Returns the output [B, n, Hq, D], the probabilities of the queries from `score_from` on summed per slot over
    queries and the group's heads [B, H, S], and the last query's averaged over the group (None where not asked)."""
    load()
    out, scores, last = torch.ops.h2o_kv.prompt_attend(q, keys, values, pos, qpos, has_padding, new_from, scaling,
                                                       want_scores, score_from, want_last)  # fmt: skip
    return out, scores if want_scores else None, last if want_last else None


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
    """`attend.attend_one` over a head-pooled row: q [B, Hq, 1, D] float32 (query head i reads KV head
    i // (Hq / heads)), keys/values [B, 1, S, D] float32, slot_head [B, 1, S] int8, pos [B, 1, S]; the output
    [B, 1, Hq, D], scores [B, 1, S] (summed over each slot's own query heads) and last (their mean)."""

    def run(query: torch.Tensor, cap: float):
        return torch.ops.h2o_kv.pooled_attend_one(query, keys, values, slot_head, pos, heads, cap)

    return _one_query(q, scaling, softcap, run)


def pooled_decode_step(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    head: torch.Tensor,
    pos: torch.Tensor,
    score: torch.Tensor,
    last: torch.Tensor | None,
    slots: torch.Tensor,
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
    qpos: torch.Tensor,
    recent: torch.Tensor,
    *,
    scaling: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """A head-pooled layer's steady decode step (pooled.py `_decode_full`), in place on its row (keys/values
    [B, 1, S, D] float32, head [B, 1, S] int8, pos, score and last [B, 1, S]): the new token's `heads` keys and
    values [B, 1, heads, D] go into the vacant `slots` [B, 1, heads] (head i into the i-th, ascending) at
    positions qpos [B, 1], the query q [B, Hq, 1, D] attends (`pooled_attend_one`), the scores grow, and every
    row frees its `heads` lowest priorities: the score, +inf for the `recent` [B, 1, 1] newest positions
    (`Policy.protected_recent`) and below `sinks` [B, 1, 1] (`Policy.protected_sinks`; None: none). Returns the output
    [B, 1, Hq, D], the freed slots [B, 1, heads] in slot order, and whether a row's heads-th and next lowest tie (then
    nothing was freed: the exact order says which go)."""
    load()
    batch, q_heads, _, dim = q.shape
    query = (q * scaling).reshape(batch, q_heads, dim)
    heads = slots.shape[-1]
    out, freed, tied = torch.ops.h2o_kv.pooled_decode_step(
        query, keys, values, head, pos, score, last, slots, new_keys, new_values, qpos.view(-1), recent.view(-1),
        heads, 0.0 if softcap is None else softcap, None if sinks is None else sinks.view(-1),
    )  # fmt: skip
    return out.view(batch, 1, q_heads, dim), freed, bool(tied)


def lowest_slots(priority: torch.Tensor, k: int) -> tuple[torch.Tensor, bool]:
    """Each row's `k` lowest priorities ([B, 1, S] float32) as slot indices [B, 1, k] in slot order, and
    whether a row's k-th and (k+1)-th lowest tie (`csrc/pooled_attend.cpp`; torch's topk, sort and compare)."""
    load()
    slots, tied = torch.ops.h2o_kv.lowest_slots(priority, k)
    return slots, bool(tied)
