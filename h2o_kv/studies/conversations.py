"""Conversations over documents through the OpenAI client, with automatic prefix reuse on and off.

    python -m h2o_kv.studies.conversations --conversations 32 --turns 4 --doc-tokens 4096 --out results/conversations

Each conversation opens with a document of about --doc-tokens tokens (a window of the offline corpus) and a
question, then asks --turns - 1 more questions, each sent when the previous answer has arrived (a chat client resends
the whole conversation every turn). Every conversation runs at once against one `h2o-kv serve` started per mode:
`reuse` (with --session-memory: a turn's prompt extends the cache the previous turn left, `runtime/prefixes.py`) and
`fresh` (without: every turn prefills the whole conversation again). Per mode and turn: time to first token, the
prompt tokens the server reused (`usage.prompt_tokens_details.cached_tokens`); per mode: generated tokens/s, the peak
KV bytes and kept bytes against --session-memory from /metrics. `--check K` replays the first K conversations of the
reuse run in this process with one `KVCache` fed the same calls (`replay.py`) and counts the answers that match.
Writes conversations.json and conversations.csv into --out.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from h2o_kv.runtime.bundled import BUNDLED_NAME
from h2o_kv.studies.report import command_line, environment, write_csv, write_json

QUESTIONS = (
    "Summarize the document above in two sentences.",
    "Who speaks first in the document, and what do they say?",
    "Quote one line of the document that mentions a place.",
    "What happens at the end of the document?",
    "Which character speaks most often in the document?",
    "List three words the document uses that are rare today.",
)
COLUMNS = ("mode turn conversations errors ttft_s_p50 ttft_s_p90 latency_s_p50 prompt_tokens_mean "
           "cached_tokens_mean completion_tokens").split()  # fmt: skip


@dataclass
class Turn:
    ttft: float | None = None
    latency: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    answer: str = ""
    finish: str | None = None
    error: str | None = None


@dataclass
class Conversation:
    messages: list[dict]
    questions: list[str]
    turns: list[Turn] = field(default_factory=list)


def documents(tokenizer, n: int, tokens: int) -> list[str]:
    """n texts of `tokens` tokens each: consecutive windows of the offline corpus."""
    from h2o_kv.studies.data import load_corpus

    ids = tokenizer(load_corpus(max_chars=n * tokens * 6), add_special_tokens=False)["input_ids"]
    if len(ids) < n * tokens:
        raise ValueError(f"the corpus has {len(ids)} tokens; {n} documents of {tokens} need {n * tokens}")
    return [tokenizer.decode(ids[i * tokens : (i + 1) * tokens]) for i in range(n)]


def conversations(docs: list[str], turns: int) -> list[Conversation]:
    """The first message holds the document and a question; each later turn asks the next question."""
    if not 1 <= turns <= len(QUESTIONS):
        raise ValueError(f"--turns must be in 1..{len(QUESTIONS)}, got {turns}")
    out = []
    for i, doc in enumerate(docs):
        asked = [QUESTIONS[(i + k) % len(QUESTIONS)] for k in range(turns)]
        out.append(Conversation(messages=[], questions=[f"{doc}\n\n{asked[0]}", *asked[1:]]))
    return out


async def _turn(client, model: str, messages: list[dict], fields: dict, max_tokens: int) -> Turn:
    import httpx
    import openai

    turn, start = Turn(), time.perf_counter()
    try:
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body=fields,
        )  # fmt: skip
        parts = []
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                turn.ttft = turn.ttft or time.perf_counter() - start
                parts.append(chunk.choices[0].delta.content)
            if chunk.choices and chunk.choices[0].finish_reason:
                turn.finish = chunk.choices[0].finish_reason
            if chunk.usage is not None:
                turn.prompt_tokens, turn.completion_tokens = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
                details = chunk.usage.prompt_tokens_details
                turn.cached_tokens = (details.cached_tokens or 0) if details is not None else 0
        turn.answer = "".join(parts)
    except (openai.OpenAIError, httpx.HTTPError) as err:  # a failed turn is counted and reported; the run goes on
        turn.error = f"{type(err).__name__}: {err}"
    turn.latency = time.perf_counter() - start
    return turn


async def _talk(client, model: str, conv: Conversation, fields: dict, max_tokens: int) -> None:
    for question in conv.questions:
        conv.messages.append({"role": "user", "content": question})
        turn = await _turn(client, model, conv.messages, fields, max_tokens)
        conv.turns.append(turn)
        if turn.error is not None:
            return
        conv.messages.append({"role": "assistant", "content": turn.answer})


async def run_mode(url: str, model: str, convs: list[Conversation], *, fields: dict, max_tokens: int,
                   timeout: float) -> tuple[float, dict]:  # fmt: skip
    """All conversations at once; (wall seconds, /metrics peaks)."""
    import httpx
    from openai import AsyncOpenAI

    from h2o_kv.studies.loadgen import watch_metrics

    peaks, stop = {}, asyncio.Event()
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=timeout, max_retries=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout)) as http:
        watcher = asyncio.create_task(watch_metrics(http, url, peaks, stop, extra=PREFIX_GAUGES))
        start = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(_talk(client, model, c, fields, max_tokens) for c in convs)), timeout)
        wall = time.perf_counter() - start
        stop.set()
        await watcher
    await client.close()
    return wall, peaks


PREFIX_GAUGES = {"h2o_kv_prefix_bytes_peak": "peak_prefix_bytes", "h2o_kv_prefix_hits_total": "prefix_hits",
                 "h2o_kv_prefix_tokens_reused_total": "prefix_tokens_reused",
                 "h2o_kv_prefix_dropped_total": "prefix_dropped"}  # fmt: skip


def summarize(mode: str, convs: list[Conversation], turns: int) -> list[dict]:
    """One row per turn index: time to first token and reuse over every conversation's turn."""
    rows = []
    for k in range(turns):
        done = [c.turns[k] for c in convs if len(c.turns) > k]
        ok = [t for t in done if t.error is None]
        ttft = [t.ttft for t in ok if t.ttft is not None]
        rows.append(dict(
            mode=mode, turn=k + 1, conversations=len(convs), errors=len(convs) - len(ok),
            ttft_s_p50=_pct(ttft, 50), ttft_s_p90=_pct(ttft, 90), latency_s_p50=_pct([t.latency for t in ok], 50),
            prompt_tokens_mean=_mean([t.prompt_tokens for t in ok]),
            cached_tokens_mean=_mean([t.cached_tokens for t in ok]),
            completion_tokens=sum(t.completion_tokens for t in ok),
        ))  # fmt: skip
    return rows


def _pct(values: list[float], q: int) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _mean(values: list[int]) -> float | None:
    return float(np.mean(values)) if values else None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=BUNDLED_NAME, help=f"model to serve (default {BUNDLED_NAME})")
    parser.add_argument("--policy", default=None, help="the server's --policy (default: the server's default)")
    parser.add_argument("--budget", default=None, help="the server's --budget (default: the server's default)")
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--doc-tokens", type=int, default=4096, help="tokens of each conversation's document")
    parser.add_argument("--max-tokens", type=int, default=32, help="most tokens per answer (default 32)")
    parser.add_argument("--kv-memory", default="2GiB", help="the server's --kv-memory (default 2GiB)")
    parser.add_argument("--session-memory", default="1GiB", help="the reuse run's --session-memory (default 1GiB)")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--prefill-chunk", type=int, default=256)
    parser.add_argument("--modes", default="reuse,fresh", help="reuse, fresh or both (default reuse,fresh)")
    parser.add_argument("--check", type=int, default=0, help="replay this many reuse conversations in-process")
    parser.add_argument("--timeout", type=float, default=7200.0, help="seconds allowed per mode")
    parser.add_argument("--out", default="results/conversations")


def main(argv: Sequence[str] | None = None) -> int:
    prog, description = "python -m h2o_kv.studies.conversations", __doc__.split("\n\n")[0]
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return _run(args, command_line(None if argv is None else ["conversations.py", *argv]))
    except (ValueError, FileNotFoundError, RuntimeError, TimeoutError) as err:
        print(f"conversations: error: {err}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace, command: str) -> int:
    from pathlib import Path

    from h2o_kv.runtime.models import load_tokenizer
    from h2o_kv.runtime.serve.launch import launch_server, served_model

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - {"reuse", "fresh"}:
        raise ValueError(f"--modes takes reuse and/or fresh, got {args.modes!r}")
    if args.check and "reuse" not in modes:
        raise ValueError("--check replays the reuse run: give --modes reuse")
    docs = documents(load_tokenizer(args.model), args.conversations, args.doc_tokens)
    policy = [*(("--policy", args.policy) if args.policy else ()), *(("--budget", args.budget) if args.budget else ())]
    out = Path(args.out)
    rows, runs = earlier(out / "conversations.json", args, modes)
    for mode in modes:
        convs = conversations(docs, args.turns)
        memory = ("--session-memory", args.session_memory) if mode == "reuse" else ()
        with launch_server(args.model, kv_memory=args.kv_memory, max_batch=args.max_batch,
                           prefill_chunk=args.prefill_chunk, extra=(*policy, *memory)) as url:  # fmt: skip
            wall, peaks = asyncio.run(run_mode(url, served_model(url), convs, fields={}, max_tokens=args.max_tokens,
                                               timeout=args.timeout))  # fmt: skip
        rows = [r for r in rows if r["mode"] != mode] + summarize(mode, convs, args.turns)
        generated = sum(t.completion_tokens for c in convs for t in c.turns if t.error is None)
        runs[mode] = dict(wall_s=wall, generated_tokens_per_s=generated / wall, **peaks,
                          conversations=[[t.__dict__ for t in c.turns] for c in convs])  # fmt: skip
        for row in rows[-args.turns :]:
            reused, prompt = _num(row["cached_tokens_mean"], ".0f"), _num(row["prompt_tokens_mean"], ".0f")
            print(f"{mode:>5} turn {row['turn']}: TTFT p50 {_num(row['ttft_s_p50'], '.2f')} s, reused {reused} of "
                  f"{prompt} prompt tokens, {row['errors']} errors", flush=True)  # fmt: skip
        if mode == "reuse" and args.check:
            from h2o_kv.studies.replay import check_answers

            runs[mode]["check"] = check_answers(args, convs[: args.check])
            check = runs[mode]["check"]
            print(f"replayed {args.check} conversations: {check['matching']} of {check['compared']} answers equal the "
                  f"one-cache run's", flush=True)  # fmt: skip
        runs[mode]["meta"] = dict(command=command, environment=environment(), settings=vars(args))
        out.mkdir(parents=True, exist_ok=True)  # each mode saved as it ends: a long run loses no finished mode
        write_json(out / "conversations.json", dict(rows=rows, runs=runs))
        write_csv(out / "conversations.csv", COLUMNS, rows)
        print(f"wrote {mode} to {out / 'conversations.json'} and {out / 'conversations.csv'}", flush=True)
    return 0 if all(row["errors"] == 0 for row in rows) else 1


STUDY = ("model", "policy", "budget", "conversations", "turns", "doc_tokens", "max_tokens", "kv_memory", "max_batch",
         "prefill_chunk")  # fmt: skip


def earlier(path, args: argparse.Namespace, modes: list[str]) -> tuple[list[dict], dict]:
    """The rows and runs of the other modes already in `path` (one mode per run, possibly in another session), kept
    when they ran the same study; a file of another study is refused rather than overwritten."""
    import json

    if not path.is_file():
        return [], {}
    old = json.loads(path.read_text())
    runs = {mode: run for mode, run in old.get("runs", {}).items() if mode not in modes}
    for mode, run in runs.items():
        theirs = run.get("meta", {}).get("settings", {})
        differ = [k for k in STUDY if theirs.get(k) != getattr(args, k)]
        if differ:
            raise ValueError(f"{path} holds a {mode} run of another study ({', '.join(differ)} differ): give another "
                             "--out, or the same settings")  # fmt: skip
    return [r for r in old.get("rows", []) if r["mode"] in runs], runs


if __name__ == "__main__":
    sys.exit(main())
