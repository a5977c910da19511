"""Why a question asked after compression misses: which needle tokens each policy kept (issue 50's probe).

The compress-once study (`h2o-kv eval --size compress-once`) compresses a RULER context alone, then answers 4
questions from forks of that cache. This script takes the study's first sample of a task (the same seed and ids),
compresses its context once per policy as the study does (a prompt call; KVzip through `h2o_kv.compress`), and
counts, per needle, the share of the needle sentence's tokens ("One of the special magic numbers for KEY is:
VALUE.") and of its value's tokens each (layer, KV head) still holds, and how many tokens each row holds beside the
context's needles (how many, how long); then answers each question from a fork as the study does (RULER's answer
length, stopped once the answer holds its gold).

    OMP_NUM_THREADS=1 .venv/bin/python compare/probe_kept.py --task niah_multikey_1 --kept 0.25 \
        --policies full,snapkv,keydiff,kvzip --out results/compress-once/probe-kept.json
    OMP_NUM_THREADS=1 .venv/bin/python compare/probe_kept.py --task niah_multikey_3 --kept 0.25,0.1 \
        --policies kvzipwindow --out results/compress-once/probe-kept-multikey3.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from h2o_kv.runtime.compress import compress
from h2o_kv.runtime.generation import eos_ids, forward, greedy_continue
from h2o_kv.runtime.models import load_model
from h2o_kv.studies.data import load_corpus
from h2o_kv.studies.eval.decoding import new_cache
from h2o_kv.studies.eval.retrieval import answer_tokens, asked, make_samples
from h2o_kv.studies.eval.ruler import score
from h2o_kv.studies.eval.ruler_fit import split_ids
from h2o_kv.studies.report import commit

NEEDLE = "One of the special magic"  # RULER's needle sentence starts so


def needle_tokens(tokenizer, context: str, ids: list[int], golds: list[str]) -> dict[str, dict[str, list[int]]]:
    """{gold: {"value": its tokens' indices, "needle": its sentence's}} in the context's ids."""
    encoded = tokenizer(context, add_special_tokens=True, return_offsets_mapping=True)
    if list(encoded["input_ids"]) != ids:
        raise ValueError("the context's ids differ from the study's (split_ids)")
    offsets = encoded["offset_mapping"]
    found = {}
    for gold in golds:
        start = context.find(gold)
        if start < 0:
            raise ValueError(f"gold {gold!r} is not in the context")
        first = context.rfind(NEEDLE, 0, start)
        first = start if first < 0 else first
        spans = {"value": (start, start + len(gold)), "needle": (first, start + len(gold))}
        found[gold] = {name: [i for i, (s, e) in enumerate(offsets) if s < b and e > a and e > s]
                       for name, (a, b) in spans.items()}  # fmt: skip
    return found


def kept_sets(cache) -> list[list[set[int]]]:
    """Per layer, per KV head: the positions held (a head-pooled row split by its tags)."""
    out = []
    for layer in cache.layers:
        pos = layer.pos[0]
        if layer.head is not None:
            tags = layer.head[0, 0]
            out.append([set(pos[0][(tags == h) & (pos[0] >= 0)].tolist()) for h in range(layer.kv_heads)])
        else:
            out.append([set(row[row >= 0].tolist()) for row in pos])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--task", default="niah_multikey_1")
    parser.add_argument("--kept", default="0.25", help="the fractions of the context kept, comma-separated")
    parser.add_argument("--policies", default="full,snapkv,keydiff,kvzip")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model(args.model)[:2]
    haystack = load_corpus(None, max_chars=2_000_000)  # the study's default haystack
    sample = make_samples(tokenizer, haystack, tasks=[args.task], context_tokens=args.context, n=5, questions=4)[0]
    ids, _ = split_ids(tokenizer, sample)
    asks = asked(sample)
    golds = [gold for one in asks for gold in one.answers]
    spans = needle_tokens(tokenizer, sample.context, ids, golds)
    n = len(ids)
    eos = eos_ids(model, tokenizer)
    kept = [float(k) for k in args.kept.split(",")]
    sizes = [len(parts["needle"]) for parts in spans.values()]
    report = {"model": args.model, "task": args.task, "kept": kept, "context_tokens": n, "commit": commit(),
              "threads": torch.get_num_threads(), "needles_in_context": sample.context.count(NEEDLE),
              "needle_tokens": sizes, "policies": {}}  # fmt: skip
    runs = [(name, None) for name in args.policies.split(",") if name == "full"]
    runs += [(name, k) for k in kept for name in args.policies.split(",") if name != "full"]
    for name, fraction in runs:
        cache = new_cache(name, fraction, n)  # as the study: a token budget
        policy = cache.settings.policy
        start = time.perf_counter()
        with torch.no_grad():
            if policy.reconstructs:
                compress(model, torch.tensor([ids]), cache=cache, tokenizer=tokenizer)
            else:
                forward(model, cache, torch.tensor([ids]))
        seconds = time.perf_counter() - start
        rows = [head for layer in kept_sets(cache) for head in layer]
        needles = {}
        for gold, parts in spans.items():
            needles[gold] = {}
            for part, tokens in parts.items():
                shares = [sum(t in row for t in tokens) / len(tokens) for row in rows]
                needles[gold][part] = {"mean": round(sum(shares) / len(shares), 3),
                                       "whole": round(sum(s == 1.0 for s in shares) / len(shares), 3)}  # fmt: skip
        answers = []
        for i, one in enumerate(asks):
            question = split_ids(tokenizer, one)[1]
            mine = cache.fork() if i < len(asks) - 1 else cache
            positions = torch.arange(n, n + len(question)).unsqueeze(0)
            with torch.no_grad():
                logits = forward(model, mine, torch.tensor([question]), positions=positions)
                out = greedy_continue(
                    model,
                    mine,
                    logits,
                    n + len(question),
                    answer_tokens(args.task, None),
                    eos,
                    lambda tokens, one=one: score(one, tokenizer.decode(tokens, skip_special_tokens=True)) == 1.0,
                )
            text = tokenizer.decode(out, skip_special_tokens=True)
            answers.append({"gold": one.answers, "answer": text.strip(), "score": score(one, text)})
        held = [len(row) for row in rows]
        report["policies"][policy.describe()] = {"seconds": round(seconds, 1), "held_per_row": {
            "mean": round(sum(held) / len(held), 1), "min": min(held), "max": max(held)},
            "needles": needles, "answers": answers}  # fmt: skip
        print(name, json.dumps(report["policies"][policy.describe()]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
