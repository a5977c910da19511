"""Where the decode kernel's first pass (`triton_decode._partial`) loses read rate at Llama-3-8B's shapes.

    python compare/gpu/decode_kernel_probe.py --out DIR            # on a CUDA machine, about a minute
    TRITON_INTERPRET=1 python compare/gpu/decode_kernel_probe.py --dry-run --out DIR   # tiny shapes on a CPU

Issue 51's profile of an eager 8B H2O step put `_partial` at 2.97 ms a step at d6b5671 against 2.03 ms at
d1c8648 for the same bytes (the kept keys and values: 7.0 GB a step at 32k x 8, 20 %). Since then the pass writes
the new token itself (WRITE), reads positions where a row has holes (HAS_POS), takes head-pooled rows. This
times one layer's pass alone (a CUDA graph of 20 launches, replayed: no host gaps) for each of WRITE x HAS_POS,
and for WRITE at other pipeline depths and tile sizes, as GB/s of keys and values read; and, on the GPU, records
from the kernels Triton compiled whether their loads are software-pipelined (asynchronous copies to shared memory
in Triton's GPU IR: `async_copy`; compiled here for sm90 with the launch's alignments, Triton 3.9 pipelines the
keys' and values' loads in every variant).
A JSON line per variant in DIR/decode_kernel.jsonl.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere: the repository's h2o_kv

from h2o_kv.backends import triton_decode  # noqa: E402
from h2o_kv.studies.bench.gpu_models import clock, sync  # noqa: E402
from h2o_kv.studies.report import provenance  # noqa: E402

SHAPES = {"llama3-8b": dict(batch=8, heads=8, q_heads=32, dim=128, slots=6553),
          "tiny": dict(batch=2, heads=2, q_heads=4, dim=16, slots=70)}  # fmt: skip
VARIANTS = [  # (write, has_pos, num_stages, block)
    (False, False, 3, 128), (False, True, 3, 128), (True, False, 3, 128), (True, True, 3, 128),
    (True, False, 1, 128), (True, False, 2, 128), (True, False, 4, 128), (True, False, 3, 64), (False, False, 3, 64),
]  # fmt: skip


def inputs(shape: dict, device, dtype):
    b, h, hq, d, s = (shape[k] for k in ("batch", "heads", "q_heads", "dim", "slots"))
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(b, hq, 1, d, device=device, dtype=dtype, generator=g)
    keys = torch.randn(b, h, s, d, device=device, dtype=dtype, generator=g)
    values = torch.randn(b, h, s, d, device=device, dtype=dtype, generator=g)
    pos = torch.arange(s, device=device).expand(b, h, s).contiguous()
    new_key, new_value = (torch.randn(b, h, d, device=device, dtype=dtype, generator=g) for _ in range(2))
    vacant, new_pos = torch.full((b, h, 1), s // 3, device=device), torch.full((b,), s, device=device)
    write = (new_key, new_value, vacant, new_pos, None, None, pos)  # triton_decode._partials' `write`
    return q, keys, values, pos, write


def ms_per_call(call, device, launches: int = 20) -> float:
    """Milliseconds per call: on a GPU a CUDA graph of `launches` calls, replayed (no host gaps), the median of 5
    replays; else one call."""
    if device.type != "cuda":
        return clock(device, call) * 1e3
    call()  # compile
    sync(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            call()
    graph.replay()
    return statistics.median(clock(device, graph.replay) for _ in range(5)) * 1e3 / launches


def compiled(fn) -> dict:
    """The kernels Triton's JIT compiled for `fn` so far, by key (its per-device caches: the kernel cache first)."""
    caches = [entry[0] for entry in getattr(fn, "device_caches", {}).values() if isinstance(entry[0], dict)]
    return {key: kernel for cache in caches for key, kernel in cache.items()}  # none found: `kernels` 0 in the row


def pipelined_loads(kernels: list) -> dict:
    """Counts in the GPU IR of the kernels a variant compiled: asynchronous copies to shared memory (software-
    pipelined loads) and plain loads."""
    irs = [kernel.asm["ttgir"] for kernel in kernels]
    return dict(kernels=len(irs), async_copy=[ir.count("async_copy_global_to_local") for ir in irs],
                plain_loads=[ir.count("tt.load ") for ir in irs])  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on a CPU (TRITON_INTERPRET=1)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu" if args.dry_run else "cuda")
    shape = SHAPES["tiny" if args.dry_run else "llama3-8b"]
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    q, keys, values, pos, write = inputs(shape, device, dtype)
    kv_bytes = 2 * keys.numel() * keys.element_size()
    tiles = triton_decode.TILES[device.type]
    saved = dict(tiles)
    nsplit = triton_decode.splits(shape["batch"] * shape["heads"], shape["slots"], device)
    with open(args.out / "decode_kernel.jsonl", "a") as log:
        for has_write, has_pos, stages, block in VARIANTS:
            tiles.update(num_stages=stages, block=block)
            try:
                call = functools.partial(triton_decode._partials, q, keys, values, pos if has_pos else None, None,
                                         None, 0.088, write if has_write else None)  # fmt: skip
                before = compiled(triton_decode._partial) if device.type == "cuda" else {}
                ms = ms_per_call(call, device)
                row = dict(write=has_write, has_pos=has_pos, num_stages=stages, block=block, nsplit=nsplit,
                           ms=round(ms, 4), kv_gb_s=round(kv_bytes / ms / 1e6, 1))  # fmt: skip
                if device.type == "cuda":
                    kernels = [k for key, k in compiled(triton_decode._partial).items() if key not in before]
                    row.update(pipelined_loads(kernels))
            finally:
                tiles.clear()
                tiles.update(saved)
            row.update(shape="tiny" if args.dry_run else "llama3-8b", kv_bytes=kv_bytes, **provenance())
            print(json.dumps(row), flush=True)
            log.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
