"""`h2o-kv eval`: accuracy of a model under KV-cache policies and budgets (see `run.run_eval`).

    h2o-kv eval --size tiny                       # a first look, under a minute: tables and plots in eval-runs/
    h2o-kv eval                                   # small (minutes on a CPU) on the bundled model
    h2o-kv eval --size large --out results/eval   # the fuller protocol (long; hours on a CPU), the committed tables
    h2o-kv eval --size large --resume             # after an interruption: reuse the finished cells
    h2o-kv eval --tasks perplexity --budgets 64,128,256 --corpus my_texts/
    h2o-kv eval --tasks summarize --data xsum.jsonl
    h2o-kv eval --model qwen2.5-coder-0.5b --tasks retrieval --size ruler4k --setting both --budgets 0.25
    h2o-kv eval --model qwen2.5-coder-0.5b --size compress-once   # issue 50: each context compressed once, 4 questions
Also runnable as `python -m h2o_kv.studies.eval.cli ...`.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

from h2o_kv.studies.eval import parse_budgets
from h2o_kv.studies.eval.sizes import (
    DEFAULT_BUDGETS,
    DEFAULT_POLICIES,
    DEFAULT_TASKS,
    SIZES,
    TASKS,
    check_eval,
    check_retrieval,
)
from h2o_kv.studies.report import command_line, extra_installed, run_study, study_parser

SETTINGS = {"query-aware": ("oneshot",), "query-agnostic": ("agnostic",), "both": ("oneshot", "agnostic")}


def _budgets(text: str) -> list[float | int]:
    try:
        return parse_budgets(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _list(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


class _Given(argparse.Action):
    """Stores the value and notes that the flag was given (a size's own tasks, policies and budgets yield to it)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        namespace.given = getattr(namespace, "given", set()) | {self.dest}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", default="smollm2-135m", help="bundled name, local HF dir, .gguf file or hub id")
    add("--device", default="cpu")
    add("--tasks", action=_Given, default=",".join(DEFAULT_TASKS),
        help=f"comma list of {', '.join(TASKS)} (a size with its own, compress-once: those)")  # fmt: skip
    add(
        "--policies",
        action=_Given,
        default=",".join(DEFAULT_POLICIES),
        help="comma list (a name ending in -int8 stores int8 KV); Full always runs as the reference (a size with its "
        "own, compress-once: those)",
    )
    add(
        "--budgets",
        action=_Given,
        type=_budgets,
        default=",".join(map(str, DEFAULT_BUDGETS)),
        help="fractions of the length (0.05,0.1,0.2,0.5) or token counts (64,128,256) (a size with its own, "
        "compress-once: those)",
    )
    add(
        "--size",
        default="small",
        choices=sorted(SIZES),
        help="tiny: a first look in under a minute; small: minutes on a CPU; large: the fuller protocol; niah: "
        "needle retrieval, 20 samples per context; ruler: passkey and variable tracking, 20 samples (the kvpress "
        "side by side's); qwen: the real-model study (needle, passkey, variable tracking at 4k and 2k, 20 samples; "
        "perplexity over 2k windows), for --model qwen2.5-coder-0.5b; ruler4k: RULER's thirteen tasks at 4k, 5 samples "
        "each, query-aware and query-agnostic (issue 52); compress-once: RULER's multikey, multivalue and QA tasks at "
        "4k, each context compressed once without its questions, then 4 questions answered from forks of that cache, "
        "5 samples each, 8 policies at 25 %% and 10 %% (issue 50)",
    )
    add(
        "--setting",
        default=None,
        choices=sorted(SETTINGS),
        help="query-aware: the question inside the compressed prompt (prefill oneshot); query-agnostic: the context "
        "compressed alone, the question fed after it (prefill agnostic; RULER's thirteen tasks); both (default: the "
        "size's prefills)",
    )
    add("--mode", default="drop", choices=["drop", "mask"], help="drop frees evicted tokens (faster, same numbers)")
    add("--corpus", default=None, help="text file, directory of *.txt or HF dataset name[:config][:split]")
    add("--data", default=None, help="JSONL with fields document and summary (for --tasks summarize)")
    add("--chunk", type=int, default=None, help="tokens fed between evictions when streaming (1: token by token)")
    add("--contexts", default=None, help="retrieval context lengths, e.g. 1024,2048 (default: the size's)")
    add(
        "--retrieval-tasks",
        default=None,
        help="retrieval tasks, e.g. niah_single,passkey, RULER's niah_single_1,vt,qa_1 or 'ruler' for its thirteen "
        "(default: the size's)",
    )
    add("--samples", type=int, default=None, help="retrieval samples per task and context (default: the size's)")
    add(
        "--questions",
        type=int,
        default=None,
        help="questions per context for RULER's niah_multikey_* and qa_* (query-agnostic: the context compressed once, "
        "each question answered from a fork; others keep one question); 1: one question, as always (default: the "
        "size's)",
    )
    add("--prefills", default=None, help="retrieval prefill settings: oneshot,agnostic,stream (default: the size's)")
    add("--windows", type=int, default=None, help="perplexity text windows (default: the size's)")
    add(
        "--out",
        default=None,
        help="output directory (tables and plots; finished cells in OUT/cells); default: a new "
        "folder eval-runs/SIZE-YYYYmmdd-HHMMSS, never the committed results/",
    )
    add(
        "--resume",
        action="store_true",
        help="reuse the finished perplexity and retrieval cells in OUT/cells whose model, settings and h2o-kv "
        "source match, and run only the rest (an interrupted study picks up where it stopped)",
    )
    add("--seed", type=int, default=0)
    add("--threads", type=int, default=None, help="torch CPU threads")
    add("--no-progress", action="store_true", help="no progress bar")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `eval` subcommand on an argparse subparsers object (runs `main` as args.func)."""
    return study_parser(subparsers, "eval", "accuracy under KV budgets: perplexity, retrieval, fidelity, summarisation",
                        __doc__, add_arguments, main, show_defaults=True)  # fmt: skip


def main(args: argparse.Namespace) -> int:
    """Load the model, run the evaluation, write the results and print where they are."""
    if not extra_installed("eval", "eval", ("matplotlib", "tqdm")):
        return 2
    preset, given = SIZES[args.size], getattr(args, "given", set())
    if preset.eval_tasks is not None and "tasks" not in given:
        args.tasks = ",".join(preset.eval_tasks)
    if preset.policies is not None and "policies" not in given:
        args.policies = ",".join(preset.policies)
    if preset.budgets is not None and "budgets" not in given:
        args.budgets = list(preset.budgets)
    check_eval(_list(args.tasks), _list(args.policies), args.data)  # bad names: one line, before torch loads
    tasks = _subtasks(args.retrieval_tasks)
    if args.samples is not None and args.samples < 1:
        raise ValueError(f"--samples must be at least 1, got {args.samples}")
    questions = getattr(args, "questions", None)
    if questions is not None and questions < 1:
        raise ValueError(f"--questions must be at least 1, got {questions}")
    prefills = _prefills(args.prefills)
    if args.setting is not None:
        if prefills is not None:
            raise ValueError("give --setting or --prefills, not both")
        prefills = SETTINGS[args.setting]
    size = preset.with_contexts(_contexts(args.contexts), prefills, tasks, args.samples, questions)
    size = size.with_windows(args.windows)
    if "retrieval" in _list(args.tasks):
        check_retrieval(size.retrieval)
    if args.out is None:  # a new folder per run: a first try never overwrites the committed results/eval
        args.out = f"eval-runs/{args.size}-{time.strftime('%Y%m%d-%H%M%S')}"
    import torch

    from h2o_kv.runtime.models import load_model
    from h2o_kv.studies.eval.run import run_eval

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, device=args.device)
    rows = run_eval(model, tokenizer, tasks=_list(args.tasks), policies=_list(args.policies), budgets=args.budgets,
                    size=size, mode=args.mode, corpus=args.corpus, data=args.data, seed=args.seed, out_dir=args.out,
                    progress=not args.no_progress, chunk=args.chunk, command=command_line(),
                    resume=args.resume)  # fmt: skip
    print(f"{len(rows)} rows; tables and plots in {args.out}/ (summary: {args.out}/summary.md)")
    return 0


def _contexts(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        values = tuple(int(item) for item in text.split(",") if item.strip())
    except ValueError:
        raise ValueError(f"--contexts must be token counts such as 1024,2048, got {text!r}") from None
    if not values or min(values) < 64:
        raise ValueError(f"--contexts must be token counts of at least 64, got {text!r}")
    return values


def _subtasks(text: str | None) -> tuple[str, ...] | None:
    from h2o_kv.studies.eval.ruler import RULER_TASKS, TASKS

    if text is None:
        return None
    values = tuple(item.strip() for item in text.split(",") if item.strip())
    values = tuple(t for v in values for t in (RULER_TASKS if v == "ruler" else (v,)))
    if not values or set(values) - set(TASKS + RULER_TASKS):
        raise ValueError(f"--retrieval-tasks must be among {','.join(TASKS + RULER_TASKS)} or 'ruler', got {text!r}")
    return values


def _prefills(text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    values = tuple(item.strip() for item in text.split(",") if item.strip())
    if not values or set(values) - {"oneshot", "agnostic", "stream"}:
        raise ValueError(f"--prefills must be among oneshot, agnostic and stream, got {text!r}")
    return values


def _main(argv: Sequence[str] | None = None) -> int:
    return run_study("python -m h2o_kv.studies.eval.cli", "eval", __doc__, add_arguments, main, argv)


if __name__ == "__main__":
    sys.exit(_main())
