"""The engine's host work per decode step, apart from the step itself: what a GPU waits for between replays.

    OMP_NUM_THREADS=1 python compare/engine_host.py --layers 30 --steps 1000

A random Llama of tiny widths and `--layers` layers (the host's per-layer work is what depth sets; widths only make
the step, which is not measured), 8 requests of 40-96 tokens at H2O 20 % in one batch with rows in place, and
captured steps whose replay does nothing but what a CUDA graph's replay does on the host (`note_replayed_step`):
once the batch is replayed, each `Engine.step()` is the engine's own work around a step (the steady check, each
token to the host, sampling, the requests' text and events, the scheduler, the high-water marks). Prints the wall
and CPU microseconds per step. Triton is interpreted for the eager steps before the first replay (no C++ kernels:
their steps leave new tensors each time, which a captured step never replays). On a GPU machine `--device cuda`
runs the same with real kernels in the eager steps.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's h2o_kv
sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))


class NoReplay:
    """Records the step once (its output buffer); a replay does on the host what `CudaGraphs`' replay does."""

    def record(self, step, cache):
        out = step()
        return cache.note_replayed_step, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ["H2O_KV_TRITON"] = "1"
    from check_issue51 import word_tokenizer

    from h2o_kv.backends import native
    from h2o_kv.runtime.captured import CapturedSteps
    from h2o_kv.runtime.engine import Engine
    from h2o_kv.studies.bench import gpu_models
    from h2o_kv.studies.report import commit

    native.resolve = lambda compile_kernel: False
    device = torch.device(args.device)
    gpu_models.SHAPES["host"] = dict(gpu_models.SHAPES["tiny"], num_hidden_layers=args.layers)
    model = gpu_models.make_model("host", device, torch.float32)
    engine = Engine(model, word_tokenizer(model.config.vocab_size), max_batch=8, budget=0.2, prefill_chunk=64,
                    rows_in_place=True, captured_steps=False)  # fmt: skip
    engine._steps = steps = CapturedSteps(engine.model, eos=engine.eos, prefill_chunk=64, held=engine._note_peaks,
                                          graphs=NoReplay())  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    handles = [engine.submit(torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist(),
                             max_tokens=args.steps + 200, policy="h2o", ignore_eos=True)
               for n in (40, 56, 72, 48, 64, 80, 88, 96)]  # fmt: skip
    for _ in range(200):  # the prompts, the joins, the warm-up and the recording
        engine.step()
        if not engine._runs.prefill and steps.replayed >= 3:
            break
    if steps.replayed < 3:
        raise SystemExit("the batch was never replayed")
    wall, cpu, before = time.perf_counter(), time.process_time(), steps.replayed
    for _ in range(args.steps):
        engine.step()
    wall, cpu = (time.perf_counter() - wall) / args.steps, (time.process_time() - cpu) / args.steps
    replayed = steps.replayed - before
    for handle in handles:
        handle.cancel()
    engine.run()
    print(
        f"{args.layers} layers, 8 rows, {torch.get_num_threads()} thread(s), commit {commit()}: host work per "
        f"Engine.step {wall * 1e6:.0f} us wall, {cpu * 1e6:.0f} us CPU ({replayed} of {args.steps} steps replayed)"
    )


if __name__ == "__main__":
    main()
