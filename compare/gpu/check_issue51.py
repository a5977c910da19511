"""Issue 51's GPU checks in one command: mixed budgets on `decode_evict`, rows in place, captured steps per bucket.

    python compare/gpu/check_issue51.py --out DIR            # on a CUDA machine (check_issue51.sh runs it)
    python compare/gpu/check_issue51.py --dry-run --out DIR  # tiny shapes on a CPU, Triton interpreted

Random-weight Llama-shaped models (a step's time does not depend on the weights' values), so any GPU runs it
offline. Cells, each a JSON line in DIR/issue51.jsonl:

- `engine`: one workload (prompts of different lengths, fraction budgets: every row its own capacity; H2O, SnapKV
  and AdaKV requests, AdaKV's a head-pooled group on the pooled Triton attention) through the engine three ways:
  rows packed and eager (what a CPU runs), rows in place eager, rows in place with captured steps. In place, the
  batch's steady steps must run on `decode_evict` with a capacity per row (counted), and the captured run must
  give the in-place eager run's tokens exactly (a replay runs the same kernels); the packed run's tokens are
  compared as a fraction (other shapes, other matmul kernels). float32 and int8 KV.
- `step`: one batch of 8 prompts of different lengths (capacities 20 % of each) brought to its steady state, then
  ms per decode step: eager torch fallback (the route before issue 51: `decode_evict` only for packed layers),
  eager on `decode_evict` with per-row capacities, and that step replayed from a CUDA graph
  (`runtime/graphs.CapturedStep`); the same for 8 prompts of one length, rows in place (the storage in
  `ROW_BLOCK`s: masked) and packed (appended rows: every slot full, the unmasked kernel), for reference.
- `engine-step`: the `step` cell's ragged batch as 8 requests through the engine (rows in place, captured steps):
  once all 8 decode and the batch's step is replayed, ms per `Engine.step()` (the replayed step plus what the
  engine does around it: sampling, each token to the host, the requests' events), against the `step` cell's
  `captured_ms` for the same prompts (issue 51: within 1.15x).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere: the repository's h2o_kv

from h2o_kv.studies.bench.gpu_models import make_model, sync  # noqa: E402
from h2o_kv.studies.report import provenance  # noqa: E402

SHAPES = {  # name: (shape, dtype, prompt lengths of the `step` cell, decode steps timed)
    "gpu": ("smollm2-135m", torch.bfloat16, [1024, 1536, 2048, 2560, 3072, 3584, 4096, 1280], 64),
    "dry": ("tiny", torch.float32, [40, 56, 72, 48, 64, 80, 88, 96], 3),
}


def word_tokenizer(vocab: int):
    """A word-level tokenizer with one id per model token ("t3", "t4", ...): eos 1, pad 2; no downloads."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "<eos>": 1, "<pad>": 2, **{f"t{i}": i for i in range(3, vocab)}}
    backend = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")


def count_kernel_steps():
    """Wrap `triton_evict.decode_evict` to count its calls with a capacity per row; returns (counter, undo)."""
    from h2o_kv.backends import triton_evict

    kernel, counts = triton_evict.decode_evict, {"ragged": 0, "packed": 0}

    def counted(*args, **kwargs):
        counts["packed" if kwargs.get("capacity") is None else "ragged"] += 1
        return kernel(*args, **kwargs)

    triton_evict.decode_evict = counted
    return counts, lambda: setattr(triton_evict, "decode_evict", kernel)


def engine_cell(model, device, kv_dtype, dry: bool) -> dict:
    """The workload through the engine three ways (module docstring)."""
    from h2o_kv.runtime.engine import Engine

    tokenizer = word_tokenizer(model.config.vocab_size)
    gen = torch.Generator().manual_seed(5)
    lengths = [24 + 9 * i for i in range(10)] if dry else [200 + 137 * i for i in range(12)]
    work = [(torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist(), 6 + 5 * (i % 4),
             ("h2o", "snapkv", "adakv")[i % 3]) for i, n in enumerate(lengths)]  # fmt: skip
    out = {}
    for name, in_place, captured in (("packed", False, False), ("in_place", True, False), ("captured", True, True)):
        engine = Engine(model, tokenizer, max_batch=8, prefill_chunk=64 if dry else 512, budget=0.2,
                        kv_dtype=kv_dtype, rows_in_place=in_place, captured_steps=captured and not dry)  # fmt: skip
        if captured and dry:  # no CUDA graphs on a CPU: the stand-in that runs each replay eagerly
            rerun_steps(engine)
        counts, undo = count_kernel_steps()
        handles = [engine.submit(ids, max_tokens=n, policy=policy, ignore_eos=True) for ids, n, policy in work]
        sync(device)
        start = time.perf_counter()
        try:
            engine.run()
            sync(device)
        finally:
            undo()
        tokens = [h.result().token_ids for h in handles]
        steps = engine._steps
        out[name] = dict(tokens=tokens, seconds=round(time.perf_counter() - start, 3), kernel_steps=counts,
                         captured=getattr(steps, "captured", None), replayed=getattr(steps, "replayed", None),
                         errors=[h.result().error for h in handles if h.result().error])  # fmt: skip
    same = lambda a, b: sum(x == y for x, y in zip(out[a]["tokens"], out[b]["tokens"])) / len(work)  # noqa: E731
    summary = {name: {k: v for k, v in run.items() if k != "tokens"} for name, run in out.items()}
    exact = same("captured", "in_place")
    ok = exact == 1.0 and out["in_place"]["kernel_steps"]["ragged"] > 0 and not any(r["errors"] for r in out.values())
    return dict(cell="engine", kv_dtype=kv_dtype, requests=len(work), runs=summary, captured_equals_in_place=exact,
                in_place_equals_packed=same("in_place", "packed"), ok=ok)  # fmt: skip


def engine_step_cell(model, lengths: list[int], steps: int, device, dry: bool) -> dict:
    """ms per engine iteration once the batch of `lengths` prompts is steady and replayed (module docstring)."""
    from h2o_kv.runtime.engine import Engine

    engine = Engine(model, word_tokenizer(model.config.vocab_size), max_batch=len(lengths), budget=0.2,
                    prefill_chunk=64 if dry else 1024, rows_in_place=True, captured_steps=not dry)  # fmt: skip
    if dry:
        rerun_steps(engine)
    gen = torch.Generator().manual_seed(3)
    handles = [engine.submit(torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist(),
                             max_tokens=3 * steps + 64, policy="h2o", ignore_eos=True) for n in lengths]  # fmt: skip
    replays = engine._steps
    for _ in range(len(lengths) * 8 + 64):  # the prompts' chunks, the joins, the warm-up and the recording
        engine.step()
        if not engine._runs.prefill and replays.replayed >= 3:
            break
    assert replays.replayed >= 3, "the engine's batch was never replayed"
    before = replays.replayed
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(device)
    ms = round(1000 * (time.perf_counter() - start) / steps, 3)
    replayed = replays.replayed - before
    for handle in handles:
        handle.cancel()
    engine.run()
    return dict(cell="engine-step", lengths=lengths, engine_step_ms=ms, replayed=replayed, steps=steps,
                ok=replayed == steps)  # fmt: skip


class Rerun:
    """A CPU stand-in for CUDA graphs (the dry run): each replay runs the step again."""

    def record(self, step, cache):
        out = step()
        return (lambda: out.copy_(step())), out


def rerun_steps(engine) -> None:
    """Give `engine` (on a CPU, the dry run) captured steps whose replays run eagerly (`Rerun`), so the engine's
    recording logic runs where there are no CUDA graphs."""
    from h2o_kv.runtime.captured import CapturedSteps

    engine._steps = CapturedSteps(engine.model, eos=engine.eos, prefill_chunk=engine.prefill_chunk,
                                  held=engine._note_peaks, graphs=Rerun())  # fmt: skip


def steady_batch(model, lengths: list[int], device, in_place: bool):
    """A cache of one row per prompt length (its own 20 % capacity), joined in place (else appended: rows packed,
    the storage as wide as the widest row needs), brought to its steady state; (cache, next tokens, positions)."""
    from h2o_kv import H2O, KVCache, enable
    from h2o_kv.runtime.generation import forward, prefill

    enable(model)  # the engine cells enable it too; a run of the step cells alone needs it here
    gen = torch.Generator().manual_seed(3)
    caches, tokens = [], []
    for n in lengths:
        caches.append(KVCache(H2O(budget=0.2)))
        ids = torch.randint(3, model.config.vocab_size, (1, n), generator=gen).to(device)
        tokens.append(prefill(model, caches[-1], ids).argmax(-1))
    batch = caches[0]
    if in_place:
        batch.reserve_rows(len(lengths))
    for row, other in enumerate(caches[1:], 1):
        batch.write_rows(other, into=row if in_place else None)
    token, position = torch.cat(tokens), torch.tensor(lengths, device=device)
    for _ in range(3):  # the step after the joins is the general one; then steady
        token, position = (
            forward(model, batch, token.view(-1, 1), positions=position.view(-1, 1)).argmax(-1),
            position + 1,
        )
    assert batch.steady, "the joined batch did not reach its steady state"
    return batch, token, position


def time_steps(step, token, position, steps: int, device) -> float:
    """ms per greedy step after 3 untimed ones; tokens stay on the device."""
    for _ in range(3):
        token, position = step(token, position).argmax(-1), position + 1
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        token, position = step(token, position).argmax(-1), position + 1
    sync(device)
    return round(1000 * (time.perf_counter() - start) / steps, 3)


def step_cell(model, lengths: list[int], steps: int, device, label: str, in_place: bool = True) -> dict:
    """ms per step of a steady batch: the torch fallback, `decode_evict`, and a CUDA graph of it (module docstring)."""
    from h2o_kv.cache import routes
    from h2o_kv.runtime.generation import forward
    from h2o_kv.runtime.graphs import CapturedStep

    result = dict(cell="step", batch=label, lengths=lengths, in_place=in_place)
    triton_step = routes.triton_step

    def packed_only(layer, query, buffered, softcap):  # the route before issue 51
        return layer.packed and triton_step(layer, query, buffered, softcap)

    for name in ("fallback", "kernel", "captured"):
        routes.triton_step = packed_only if name == "fallback" else triton_step
        counts, undo = count_kernel_steps()
        try:
            cache, token, position = steady_batch(model, lengths, device, in_place)
            if name == "captured" and device.type == "cuda":
                graphed = CapturedStep(model, cache, warmup=1)
                step = lambda t, p, g=graphed: g(t, p)  # noqa: E731
            elif name == "captured":
                continue
            else:
                step = lambda t, p, c=cache: forward(model, c, t.view(-1, 1), positions=p.view(-1, 1))  # noqa: E731
            result[f"{name}_ms"] = time_steps(step, token, position, steps, device)
            result[f"{name}_kernel_steps"] = dict(counts)
        finally:
            routes.triton_step = triton_step
            undo()
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on a CPU, Triton interpreted")
    parser.add_argument("--cells", help="comma-separated cells to run (engine, engine-int8, step, step-one-length, "
                        "step-packed, engine-step; default: all)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.dry_run:  # the Triton kernels interpreted, where a GPU runs them (not the C++ kernels a CPU would)
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports Triton
        os.environ["H2O_KV_TRITON"] = "1"
        from h2o_kv.backends import native

        native.resolve = lambda compile_kernel: False
    device = torch.device("cpu" if args.dry_run else "cuda")
    shape, dtype, lengths, steps = SHAPES["dry" if args.dry_run else "gpu"]
    args.out.mkdir(parents=True, exist_ok=True)
    model = make_model(shape, device, dtype)
    same = [lengths[-1]] * len(lengths)
    cells = {"engine": lambda: engine_cell(model, device, None, args.dry_run),
             "engine-int8": lambda: engine_cell(model, device, "int8", args.dry_run),
             "step": lambda: step_cell(model, lengths, steps, device, "ragged"),
             "step-one-length": lambda: step_cell(model, same, steps, device, "one length"),
             "step-packed": lambda: step_cell(model, same, steps, device, "one length", in_place=False),
             "engine-step": lambda: engine_step_cell(model, lengths, steps, device, args.dry_run)}  # fmt: skip
    chosen = args.cells.split(",") if args.cells else list(cells)
    unknown = set(chosen) - set(cells)
    if unknown:
        parser.error(f"unknown cells {sorted(unknown)}; known: {', '.join(cells)}")
    where = provenance()  # each row: the commit, torch, triton, the GPU
    with open(args.out / "issue51.jsonl", "a") as log:
        for cell in (cells[name] for name in chosen):
            start = time.perf_counter()
            try:
                row = cell()
            except Exception as err:
                row = dict(error=f"{type(err).__name__}: {err}", trace=traceback.format_exc(limit=6))
            row.update(seconds=round(time.perf_counter() - start, 1), device=str(device), shape=shape, **where)
            print(json.dumps(row), flush=True)
            log.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
