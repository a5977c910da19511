"""`h2o-kv bench` flags and entry point (also `python -m h2o_kv.studies.bench`)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from h2o_kv.policies import parse_budget
from h2o_kv.studies.bench.config import EXTRA_POLICIES, POLICIES, SIZES
from h2o_kv.studies.report import extra_installed, run_study, study_parser

DESCRIPTION = (
    "Throughput and memory: the stock model (SDPA with DynamicCache and with StaticCache) against "
    "h2o-kv's bounded caches, over prompt lengths, batch sizes and thread counts."
)
EPILOG = """examples:
  h2o-kv bench --size small                  # CI-sized: 256/1024 tokens, batch 1/2, 32 new tokens
  h2o-kv bench --size large --threads 0,1    # 1024/4096 tokens, batch 1/4, default threads and one thread
  h2o-kv bench --budget 256 --dtype bfloat16 # 256 tokens per head (an int is tokens, 0.2 is 20 %)
  h2o-kv bench --soak 10000 --prompt-lens 512 # one H2O cache, 10,000 steps: flat nbytes and RSS
"""


def _budget(text: str) -> int | float:
    try:
        return parse_budget(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _name_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench flags; explicit size flags override the --size preset."""
    add = parser.add_argument
    add("--model", default="smollm2-135m", help="model name or path (default: the bundled SmolLM2-135M)")
    add(
        "--policies",
        type=_name_list,
        default=list(POLICIES),
        help=f"comma list from {', '.join(POLICIES + EXTRA_POLICIES)}, any h2o-kv policy with -int8 for int8 "
        f"KV storage, e.g. h2o-int8 (default: {','.join(POLICIES)})",
    )
    add(
        "--budget",
        type=_budget,
        default=0.2,
        help="KV budget per (sequence, KV head): tokens (256) or a fraction of the prompt (0.2, 20%%); default 0.2",
    )
    add(
        "--size",
        choices=sorted(SIZES),
        default="small",
        help="preset sizes: small (CI, a few minutes on 2 CPU cores) or large (the committed run)",
    )
    add("--prompt-lens", type=_int_list, help="comma list of prompt lengths")
    add("--gen-len", type=int, help="tokens generated per sequence")
    add("--batch-sizes", type=_int_list, help="comma list of batch sizes")
    add("--repeats", type=int, help="timed runs per configuration (medians are reported)")
    add("--warmup", type=int, help="untimed runs per configuration before the timed ones")
    add(
        "--threads",
        type=_int_list,
        default=[0],
        help="comma list of torch CPU thread counts, 0 = the machine's default (default 0); e.g. 0,1",
    )
    add("--device", default="auto", help="cpu, cuda or auto (default)")
    add(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="model and KV dtype (default: float32 on CPU, bfloat16 on CUDA)",
    )
    add(
        "--interleave",
        action="store_true",
        help="hold every policy's cache at once and decode them in turn, one step each, so a machine that "
        "speeds up or slows down during the run shifts them alike (the ratios are then the trustworthy figures)",
    )
    add("--prefill-chunk", type=int, default=None, help="prefill h2o-kv caches in chunks of this many tokens")
    add(
        "--memory-cap-gb",
        type=float,
        default=None,
        help="KV-cache memory cap for the same-memory run (default: the stock caches' KV at the largest batch)",
    )
    add(
        "--out",
        default=None,
        help="output directory; default: a new folder bench-runs/SIZE-YYYYmmdd-HHMMSS (bench-runs/soak-... with "
        "--soak), never the committed results/",
    )
    add("--profile", action="store_true", help="also write torch.profiler tables of an H2O prefill and decode step")
    add("--no-progress", action="store_true", help="no progress bar")  # fmt: skip
    add("--check", action="store_true", help="exit 1 when a bar FAILs (a bar defined at another shape SKIPs)")
    add_soak_arguments(parser)


def add_soak_arguments(parser: argparse.ArgumentParser) -> None:
    """The soak flags; the soak also reads --model, --budget, --device, --dtype, --threads (first),
    --batch-sizes (first), --prompt-lens (first, default 512), --policies (first h2o-kv policy) and --out."""
    group = parser.add_argument_group("soak (instead of the sweep)")
    add = group.add_argument
    add("--soak", type=int, metavar="STEPS", default=None, help="decode STEPS tokens on one cache, check flat memory")
    add("--soak-every", type=int, metavar="K", default=100, help="sample memory every K steps (default 100)")
    add("--soak-warmup", type=int, metavar="STEPS", default=None, help="steps before RSS growth counts (default 10%%)")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `bench` subcommand on an argparse subparsers object (runs `main` as args.func)."""
    return study_parser(subparsers, "bench", "throughput and memory benchmark", DESCRIPTION, add_arguments, main,
                        epilog=EPILOG)  # fmt: skip


def main(args: argparse.Namespace) -> int:
    """Run the benchmark from parsed flags, write the results, print the table and the bars."""
    if not extra_installed("bench", "bench", ("matplotlib", "tqdm")):
        return 2
    import torch

    from h2o_kv.studies.bench.config import check_run
    from h2o_kv.studies.bench.soak import main as soak_main

    if args.out is None:  # a new folder per run: a first try never overwrites the committed results/
        args.out = run_folder("soak" if args.soak is not None else args.size)
    if args.soak is not None:
        return soak_main(args)
    out = args.out
    from h2o_kv.runtime.models import load_model
    from h2o_kv.studies.bench.bars import check_bars, format_bars, summary_table
    from h2o_kv.studies.bench.output import write_results
    from h2o_kv.studies.bench.profile import profile_h2o
    from h2o_kv.studies.bench.sweep import load_text, run_bench

    sizes = dict(SIZES[args.size])
    sizes.update({key: getattr(args, key) for key in sizes if getattr(args, key) is not None})
    # bad flags: one line, before the model loads
    check_run(args.policies, args.budget, threads=args.threads, prefill_chunk=args.prefill_chunk,
              memory_cap_gb=args.memory_cap_gb, **sizes)  # fmt: skip
    started = time.perf_counter()
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    rows = run_bench(model, tokenizer, policies=args.policies, budget=args.budget, threads=args.threads,
                     memory_cap_gb=args.memory_cap_gb, prefill_chunk=args.prefill_chunk,
                     progress=not args.no_progress, interleave=args.interleave, **sizes)  # fmt: skip
    paths = write_results(rows, out)
    if args.profile:
        token_ids = tokenizer(load_text(), add_special_tokens=False)["input_ids"]
        largest = dict(prompt_len=max(sizes["prompt_lens"]), batch=max(sizes["batch_sizes"]))
        if args.threads[0]:
            torch.set_num_threads(args.threads[0])
        paths |= profile_h2o(model, token_ids, budget=args.budget, out_dir=Path(out), **largest)
    print(summary_table(rows))
    bars = check_bars(rows)
    print(format_bars(bars))
    files = ", ".join(sorted(p.name for p in paths.values()))
    print(f"bench: {time.perf_counter() - started:.0f} s; wrote {files} to {out}")
    failed = [b["bar"] for b in bars if b["passed"] is False]
    if args.check and failed:  # --check: a failed bar is a failed run (SKIP is not)
        print(f"bench: {len(failed)} bar(s) failed: {'; '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def run_folder(kind: str) -> str:
    """A folder no run has used: bench-runs/KIND-YYYYmmdd-HHMMSS, with -2, -3 ... when that one exists."""
    base = f"bench-runs/{kind}-{time.strftime('%Y%m%d-%H%M%S')}"
    out, n = base, 1
    while Path(out).exists():
        n += 1
        out = f"{base}-{n}"
    return out


def run_cli(argv: Sequence[str] | None = None) -> int:
    """`python -m h2o_kv.studies.bench`: parse the flags and run, errors as one line."""
    return run_study("python -m h2o_kv.studies.bench", "bench", DESCRIPTION, add_arguments, main, argv, EPILOG)
