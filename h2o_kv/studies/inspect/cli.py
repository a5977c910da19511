"""The `h2o-kv inspect` subcommand: flags, the prompt (an argument, a file or standard input), the run, the page.

    h2o-kv inspect notes.txt --policy snapkv --policy h2o --budget 0.2 --question "Who signed?" --out report.html

Bad input (an empty prompt, an unknown policy, a file that is not text, a prompt past the model's context) is one
line and exit 2, as everywhere in the CLI; all but the context are refused before the model loads.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from h2o_kv import policies
from h2o_kv.runtime.bundled import BUNDLED_NAME

DEFAULT_POLICIES = ("snapkv", "h2o")
DEFAULT_BUDGET = 0.2
QUESTION_TOKENS = 32  # --decode's default with --question: room for a short answer


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `inspect` on the CLI's subparsers (runs `main` as args.func)."""
    from h2o_kv.cli import _budget, _int_at_least

    parser = subparsers.add_parser(
        "inspect",
        help="an HTML page of what each policy's cache kept of a prompt (was the fact still there?)",
        description="Run a prompt under each --policy and write one self-contained HTML page: the prompt shaded by "
        "the share of (layer, KV head) rows that kept each token, a layers x positions picture per policy, the "
        "answers and the kept bytes.",
    )
    parser.add_argument("prompt", nargs="?", default=None, metavar="PROMPT_OR_FILE",
                        help="the prompt, or a text file holding it (or --file, or standard input)")  # fmt: skip
    parser.add_argument("--file", default=None, help="read the prompt from a file")
    parser.add_argument("--policy", action="append", default=None, metavar="NAME[@BUDGET]",
                        help=f"a policy to inspect, repeatable (default: {' and '.join(DEFAULT_POLICIES)}); one of "
                        f"{', '.join(policies.NAMES)}, with its own budget after @ (snapkv@0.1)")  # fmt: skip
    parser.add_argument("--budget", type=_budget, default=DEFAULT_BUDGET,
                        help=f"budget of a --policy without @: tokens (64) or a fraction of the prompt (0.2, 20%%) "
                        f"(default {DEFAULT_BUDGET})")  # fmt: skip
    parser.add_argument("--question", default=None, help="asked after the prompt; each policy's answer is shown")
    parser.add_argument("--decode", type=_int_at_least(0), default=None, metavar="N",
                        help=f"greedy tokens generated before the map is taken (default 0, or {QUESTION_TOKENS} to the "
                        "answer's line end with --question)")  # fmt: skip
    parser.add_argument("--out", default="inspect.html", help="the page to write (default inspect.html)")
    parser.add_argument("--model", default=BUNDLED_NAME, help=f"bundled name, HF id, local dir or .gguf file (default "
                        f"{BUNDLED_NAME})")  # fmt: skip
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-chat", dest="chat", action="store_false", help="do not apply the chat template")
    parser.add_argument("--prefill-chunk", type=_int_at_least(1), default=None,
                        help="read the prompt in chunks of this size, evicting between them")  # fmt: skip
    parser.add_argument("--mode", default="drop", choices=["drop", "mask"],
                        help="drop frees evicted tokens; mask keeps them masked (the paper's simulation)")  # fmt: skip
    parser.set_defaults(func=main)
    return parser


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt: PROMPT_OR_FILE names a file when one exists there, else it is the text; or --file, or standard
    input. Refuses a missing, unreadable, binary or empty one."""
    from h2o_kv.cli import _read_prompt

    given = args.prompt
    if given is not None and args.file is None and "\n" not in given and len(given) < 4096 and os.path.exists(given):
        args = argparse.Namespace(**{**vars(args), "prompt": None, "file": given})
    text = _read_prompt(args)
    if "\x00" in text:
        source = "standard input" if args.file is None and args.prompt is None else args.file or "the prompt argument"
        raise ValueError(f"{source} is not text (it holds NUL bytes)")
    return text


def main(args: argparse.Namespace) -> int:
    from h2o_kv.studies.inspect.run import parse_policies

    text = read_prompt(args)
    asked = parse_policies(args.policy or list(DEFAULT_POLICIES), args.budget)
    if args.question is not None and not args.question.strip():
        raise ValueError("--question is empty")
    out = Path(args.out)
    if out.is_dir():
        raise ValueError(f"--out {out} is a directory: name the page's file")
    if not out.parent.is_dir():
        raise ValueError(f"--out {out}: the folder {out.parent} does not exist")
    from h2o_kv.runtime.models import check_device, check_model, load_model
    from h2o_kv.studies.inspect.page import render
    from h2o_kv.studies.inspect.run import inspect

    check_device(args.device)
    check_model(args.model)
    model, tokenizer = load_model(args.model, device=args.device)
    decode = args.decode if args.decode is not None else (QUESTION_TOKENS if args.question is not None else 0)

    def progress(run) -> None:
        share = float(run.kept.fraction().mean())
        print(f"{run.label}: {run.kept.positions} positions seen, {share:.0%} kept on average, "
              f"{run.seconds:.1f} s", file=sys.stderr, flush=True)  # fmt: skip

    inspection = inspect(model, tokenizer, text, asked, model_name=args.model, question=args.question,
                         decode=decode, chat=args.chat, prefill_chunk=args.prefill_chunk, mode=args.mode,
                         progress=progress)  # fmt: skip
    page = render(inspection)
    out.write_text(page, encoding="utf-8")
    print(f"wrote {out} ({len(page.encode()) / 2**20:.1f} MiB): {inspection.prompt_tokens} prompt tokens, "
          f"{len(inspection.runs)} policies")  # fmt: skip
    for run in inspection.runs:
        if run.new_tokens:
            print(f"  {run.label}: {run.answer}")
    return 0
