"""Issue 51's end-to-end GPU serving run: the engine `h2o-kv serve` runs, H2O at 20 % against `Full()` on it.

    python compare/gpu/serving_run.py --out DIR             # on a CUDA machine (check_issue51.sh runs it)
    python compare/gpu/serving_run.py --dry-run --out DIR   # tiny shapes on a CPU, Triton interpreted

Llama-3-8B's shapes with random weights in bfloat16 (a step's time does not depend on the weights' values), 32
requests submitted at once with prompts spread evenly over 4k-32k tokens, 256 new tokens each (greedy, no end
of sequence), at one KV memory size (`Engine(kv_memory=...)`): each policy gets the same bytes and admits what
fits. Before each measured run the same engine serves two short requests (the kernels compiled, a first graph
recorded). Each request's events give its time to first token (from its submission, so queueing counts) and its
inter-token gaps; tokens/s is every new token over the run's wall time; `prefill_s` and `decode_s` split the run's
time between the engine's prefill work and its decode steps (each timed with the device drained before and after,
which the engine itself never does, so the split costs a little time), and the decode calls split again into
those that replayed a recording, recorded one or ran eagerly (`decode_calls`: seconds and counts);
`triton_compiled` counts the Triton kernels compiled during the measured run, per kernel (a new batch bucket or
slot count can take a new variant: the merge kernel's split count is a compile-time constant). Rows go to
DIR/serving.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere: the repository's h2o_kv
sys.path.insert(0, str(Path(__file__).resolve().parent))

from check_issue51 import rerun_steps, word_tokenizer  # noqa: E402

from h2o_kv.studies.bench.gpu_models import make_model, sync  # noqa: E402
from h2o_kv.studies.report import provenance  # noqa: E402

SETUPS = {
    "gpu": dict(shape="llama3-8b", dtype=torch.bfloat16, requests=32, shortest=4096, longest=32768, new=256,
                kv_memory=32 << 30, prefill_chunk=4096, warm=1024),
    "dry": dict(shape="tiny", dtype=torch.float32, requests=6, shortest=64, longest=192, new=12,
                kv_memory=1 << 20, prefill_chunk=64, warm=48),
}  # fmt: skip


KINDS = ("replayed", "recorded", "eager")  # a decode call's kind (timed_phases)


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def timed_phases(steps, device) -> dict:
    """Wrap the engine's `steps.prefill` and `steps.decode` to sum the seconds each takes; returns the sums, and the
    decode calls split by whether they replayed a recording (`replayed_*`), recorded one (`recorded_*`: the capture
    and its first run) or ran eagerly (`eager_*`: not steady, or a new recording's warm-up, which compiles the
    kernels for its shapes), each kind's count and seconds."""
    spent = {"prefill_s": 0.0, "decode_s": 0.0} | {f"{k}_{u}": 0 for k in KINDS for u in ("calls", "s")}
    for name in ("prefill", "decode"):
        work = getattr(steps, name)

        def timed(*args, work=work, name=name):
            sync(device)
            counts, start = (getattr(steps, "replayed", 0), getattr(steps, "captured", 0)), time.perf_counter()
            work(*args)
            sync(device)
            seconds = time.perf_counter() - start
            spent[f"{name}_s"] += seconds
            if name == "decode":
                replayed, recorded = (
                    getattr(steps, "replayed", 0) > counts[0],
                    getattr(steps, "captured", 0) > counts[1],
                )
                kind = "replayed" if replayed else "recorded" if recorded else "eager"
                spent[f"{kind}_calls"] += 1
                spent[f"{kind}_s"] += seconds

        setattr(steps, name, timed)
    return spent


def triton_variants() -> dict[str, int]:
    """The compiled variants of each of h2o-kv's Triton kernels so far (none under the interpreter, which compiles
    nothing): a JIT function keeps one per specialization in its per-device cache (`decode_kernel_probe.compiled`).
    Imported here, not at the top: a dry run sets TRITON_INTERPRET before the kernels are defined."""
    from decode_kernel_probe import compiled

    from h2o_kv.backends import triton_decode, triton_evict, triton_scores

    return {f"{module.__name__.rsplit('.', 1)[-1]}.{name}": len(compiled(fn))
            for module in (triton_decode, triton_evict, triton_scores)
            for name, fn in vars(module).items() if hasattr(fn, "device_caches")}  # fmt: skip


def serve(model, tokenizer, policy: str, setup: dict, device) -> dict:
    """One measured run of `policy` on a fresh engine (module docstring)."""
    from h2o_kv.runtime.engine import Engine

    dry = device.type != "cuda"
    name, _, fraction = policy.partition("@")  # h2o@1.0: every prompt token kept, on the bounded (captured) path
    engine = Engine(model, tokenizer, policy=name, budget=float(fraction or 0.2), kv_memory=setup["kv_memory"],
                    max_batch=setup["requests"], prefill_chunk=setup["prefill_chunk"],
                    rows_in_place=dry or None)  # fmt: skip
    if dry:  # no CUDA graphs on a CPU: each replay runs the step again
        rerun_steps(engine)
    vocab, gen = model.config.vocab_size, torch.Generator().manual_seed(11)
    for _ in range(2):  # warm-up, not measured
        engine.submit(torch.randint(3, vocab, (setup["warm"],), generator=gen).tolist(), max_tokens=8, ignore_eos=True)
    engine.run()
    engine.reset_peaks()
    n, low, high = setup["requests"], setup["shortest"], setup["longest"]
    lengths = [low + (high - low) * i // (n - 1) for i in range(n)]
    order = torch.randperm(n, generator=gen).tolist()  # lengths mixed in the queue, the same order for each policy
    times: list[list[float]] = [[] for _ in range(n)]
    handles = []
    spent = timed_phases(engine._steps, device)
    compiled_before = triton_variants()
    sync(device)
    start = time.perf_counter()
    for i in order:
        ids = torch.randint(3, vocab, (lengths[i],), generator=gen).tolist()
        note = lambda event, t=times[i]: event.token_id is None or t.append(time.perf_counter())  # noqa: E731
        handles.append(engine.submit(ids, max_tokens=setup["new"], ignore_eos=True, on_event=note))
    engine.run()
    sync(device)
    wall = time.perf_counter() - start
    results = [h.result() for h in handles]
    errors = [r.error for r in results if r.error]
    ttft = [t[0] - h.submitted_at for h, t in zip(handles, (times[i] for i in order)) if t]
    gaps = [b - a for t in times for a, b in zip(t, t[1:])]
    tokens = sum(r.completion_tokens for r in results)
    steps = engine._steps
    compiled = {k: n - compiled_before.get(k, 0) for k, n in triton_variants().items() if n > compiled_before.get(k, 0)}
    return dict(policy=policy, requests=n, prompt_tokens=sum(lengths), new_tokens=tokens, wall_s=round(wall, 2),
                tok_s=round(tokens / wall, 1), ttft_p50_s=round(statistics.median(ttft), 3),
                ttft_p99_s=round(quantile(ttft, 0.99), 3), itl_p50_ms=round(1000 * statistics.median(gaps), 2),
                itl_p99_ms=round(1000 * quantile(gaps, 0.99), 2), itl_mean_ms=round(1000 * statistics.mean(gaps), 2),
                prefill_s=round(spent["prefill_s"], 2), decode_s=round(spent["decode_s"], 2),
                decode_calls={k: round(spent[f"{k}_s"], 2) for k in KINDS}
                | {f"{k}_n": spent[f"{k}_calls"] for k in KINDS}, triton_compiled=compiled,
                kv_bytes_peak=engine.peaks["kv_bytes_in_use"], running_peak=engine.peaks["running"],
                kv_memory=setup["kv_memory"], captured=getattr(steps, "captured", None),
                replayed=getattr(steps, "replayed", None), errors=errors[:3],
                ok=not errors and tokens == n * setup["new"])  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on a CPU, Triton interpreted")
    parser.add_argument("--policies", default="h2o,full",
                        help="comma-separated, run in this order; NAME@FRACTION for a budget other than 20 %%: "
                        "h2o@1.0: every prompt token kept on the bounded path (Full's bytes, replayed)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = torch.device("cpu" if args.dry_run else "cuda")
    setup = SETUPS["dry" if args.dry_run else "gpu"]
    model = make_model(setup["shape"], device, setup["dtype"])
    tokenizer = word_tokenizer(model.config.vocab_size)
    args.out.mkdir(parents=True, exist_ok=True)
    where = provenance()
    with open(args.out / "serving.jsonl", "a") as log:
        for policy in args.policies.split(","):
            row = dict(serve(model, tokenizer, policy, setup, device), shape=setup["shape"], device=str(device),
                       **where)  # fmt: skip
            print(json.dumps(row), flush=True)
            log.write(json.dumps(row) + "\n")
            if device.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
