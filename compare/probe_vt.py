"""Which lines of a variable-tracking chain each policy keeps after the prompt (issue 40's vt probe, issue 52's).

A vt prompt hides one chain, "VAR A = 12345." then "VAR B = VAR A." ... "VAR E = VAR D.", in filler text, and asks
for every variable assigned 12345. This script reads exported samples (compare/kvpress/export_samples.py; `--task`
picks one task's from a file of several), records each prompt's prefill once (KVzip's pass once, where a policy
reconstructs the context) and replays it into each policy's cache (h2o_kv.studies.eval.shared, as the study does),
and counts, per chain line, the share of its tokens each (layer, KV head) still holds (`KVCache.kept_map`). The
answer needs every line. `--setting agnostic` compresses the context alone (the question comes after it), as the
RULER study's query-agnostic runs do; the budget is then a fraction of the context. `--answers`: instead, each
config's greedy answer and its RULER score (string_match_all), decoded as the study does (`shared_answers`), for a
policy the study did not run. A config's policy may replace fields of its own, each after a colon:
`keydiff:recent=0@0.25` (KeyDiff without its newest prompt tokens kept whatever their rank: the paper's rule, and
kvpress's), `snapkv:window=64:pool=5@0.25` (kvpress's SnapKV settings).

    OMP_NUM_THREADS=1 .venv/bin/python compare/probe_vt.py --samples compare/kvpress/samples-qwen-vt2k.jsonl \
        --n 10 --out results/qwen/probe-vt
    OMP_NUM_THREADS=1 .venv/bin/python compare/probe_vt.py --task vt --setting agnostic \
        --samples compare/kvpress/samples-ruler4k-qwen2.5-coder-0.5b.jsonl --configs kvzipwindow@0.25,keydiff@0.25 \
        --n 5 --out /tmp/probe-vt-ruler
    OMP_NUM_THREADS=1 .venv/bin/python compare/probe_vt.py --task vt --answers \
        --samples compare/kvpress/samples-ruler4k-qwen2.5-coder-0.5b.jsonl \
        --configs keydiff@0.125,keydiff:recent=0@0.125,keydiff@0.25,keydiff:recent=0@0.25 --n 5 \
        --out results/ruler/probe-vt-keydiff
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

import h2o_kv
from h2o_kv.cache.kvcache import KVCache
from h2o_kv.policies import budget_tokens, build
from h2o_kv.studies.eval.decoding import new_cache
from h2o_kv.studies.eval.ruler import string_match_all
from h2o_kv.studies.eval.shared import held_call, record_pass, record_prefill, replay, replay_pass, shared_answers
from h2o_kv.studies.report import commit

CONFIGS = ",".join(f"{p}@{b}" for b in (0.1, 0.2) for p in ("snapkv", "adakv", "h2o", "tova", "streamingllm"))


def config_cache(config: str, budget: float, length: int, headroom: int = 0) -> KVCache:
    """`new_cache` as the study resolves it; with `POLICY:FIELD=N[:FIELD=N]`, that policy with those fields replaced."""
    name, *fields = config.split(":")
    if not fields:
        return new_cache(name, budget, length, headroom=headroom)
    values = {key: int(value) for key, value in (field.split("=") for field in fields)}
    return KVCache(replace(build(name, budget_tokens(budget, length)), **values), headroom=headroom)


def token_spans(tokenizer, ids: list[int]) -> tuple[str, list[int]]:
    """The decoded prompt and the character offset at which each token ends."""
    ends, text = [], ""
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k])
        ends.append(len(text))
    return text, ends


def chain_tokens(text: str, ends: list[int], names: list[str]) -> list[list[int]]:
    """Token positions of each chain line ("VAR NAME = ... ."), in chain order."""
    lines = []
    for name in names:
        match = re.search(rf"VAR {name} = [^.]*\.", text)
        if match is None:
            raise ValueError(f"no line assigns {name}")
        start, stop = match.span()
        lines.append([k for k, end in enumerate(ends) if end > start and (k == 0 or ends[k - 1] < stop)])
    return lines


def line_shares(cache, lines: list[list[int]]) -> tuple[list[float], list[float]]:
    """Per chain line: the share of its tokens the (layer, KV head) rows hold, and the share of rows holding all of
    it (`KVCache.kept_map`: a head-pooled AdaKV layer's rows are its heads too)."""
    kept_map = cache.kept_map(0)
    real = torch.arange(kept_map.kept.shape[1])[None, :] < kept_map.heads[:, None]  # [layers, kv_heads]
    tokens, whole = [], []
    for line in lines:
        held = kept_map.kept[:, :, line][real]  # [rows, len(line)]
        tokens.append(held.float().mean().item())
        whole.append(held.all(-1).float().mean().item())
    return tokens, whole


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", required=True)
    parser.add_argument("--task", help="only the samples of this task (a file of several tasks)")
    parser.add_argument("--setting", choices=("aware", "agnostic"), default="aware",
                        help="aware: the whole prompt compressed; agnostic: the context alone")  # fmt: skip
    parser.add_argument("--configs", default=CONFIGS, help="POLICY@FRACTION, comma-separated")
    parser.add_argument("--n", type=int, default=10)
    parser.add_argument("--answers", action="store_true", help="each config's answer and score, not its kept lines")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    samples = [json.loads(line) for line in Path(args.samples).read_text().splitlines()]
    samples = [s for s in samples if args.task in (None, s["task"])][: args.n]
    configs = [(p, float(b)) for p, b in (c.split("@") for c in args.configs.split(","))]
    model, tokenizer = h2o_kv.load_model(samples[0]["model_dir"])
    if args.answers:
        return answers(model, tokenizer, samples, configs, args)
    shares: dict[str, list[list[float]]] = {}
    for sample in samples:
        ids = sample["input_ids"] if args.setting == "aware" else sample["context_ids"]
        text, ends = token_spans(tokenizer, ids)
        lines = chain_tokens(text, ends, sample["answers"])
        caches = {c: config_cache(c[0], c[1], len(ids)) for c in configs}  # as the study resolves them
        passed = None
        if any(cache.policy.reconstructs for cache in caches.values()):
            passed = record_pass(model, ids, tokenizer)
        _, calls = held_call(passed) if passed is not None else record_prefill(model, ids)
        for (policy, budget), cache in caches.items():
            if cache.policy.reconstructs:
                replay_pass(cache, passed[1])
            else:
                replay(cache, calls)
                cache.end_prompt()
            tokens, whole = line_shares(cache, lines)
            shares.setdefault(f"{policy} {budget:.1%}", []).append(tokens + whole)
        print(f"{sample['id']}: done", flush=True)
    table = {key: [sum(col) / len(col) for col in zip(*rows)] for key, rows in shares.items()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(
        json.dumps({"samples": args.samples, "setting": args.setting, "n": len(samples), "shares": table}, indent=1)
    )
    n = len(next(iter(table.values()))) // 2
    head = "| policy | " + " | ".join(f"line {i + 1}" for i in range(n)) + " |"
    rows = [
        f"| {key} | " + " | ".join(f"{a:.2f} / {b:.2f}" for a, b in zip(v[:n], v[n:])) + " |"
        for key, v in table.items()
    ]
    command = " ".join(["python compare/probe_vt.py", *sys.argv[1:]])
    (out / "table.md").write_text(
        f"# Which lines of a vt chain each policy keeps ({args.setting})\n\n`{command}` at {commit()}, one thread\n\n"
        f"Each chain line after the prompt: the share of its tokens held / the share of (layer, KV head) holding all "
        f"of it; means over the {len(samples)} first samples of {Path(args.samples).name} ({args.setting}). Line 1 "
        "holds the number the question names; the answer needs every line.\n\n"
        + "\n".join([head, "|" + " --- |" * (n + 1), *rows])
        + "\n"
    )
    print((out / "table.md").read_text())


def answers(model, tokenizer, samples: list[dict], configs: list[tuple[str, float]], args) -> None:
    """Each config's answer to each sample and its score; their means to OUT/answers.md."""
    scores: dict[str, list[float]] = {}
    lines = []
    for sample in samples:
        aware = args.setting == "aware"
        ids = sample["input_ids"] if aware else sample["context_ids"]
        eos = set(sample["eos_token_id"] if isinstance(sample["eos_token_id"], list) else [sample["eos_token_id"]])
        question = [] if aware else sample["question_ids"]
        # as the study: the question and answer are appended to the compressed prompt, not made room for (headroom)
        new = dict(length=len(ids), headroom=len(question) + sample["max_new_tokens"])
        caches = {c: partial(config_cache, c[0], c[1], **new) for c in configs}
        got = shared_answers(model, ids, caches, [question], max_new_tokens=sample["max_new_tokens"], eos=eos,
                             tokenizer=tokenizer)  # fmt: skip
        for (policy, budget), (outs, _) in got.items():
            text = tokenizer.decode(outs[0], skip_special_tokens=True)
            score = string_match_all(text, sample["answers"])
            scores.setdefault(f"{policy} {budget:.1%}", []).append(score)
            lines.append(f"| {sample['id']} | {policy} {budget:.1%} | {score:.2f} | {text.strip()[:70]!r} |")
        print(f"{sample['id']}: done", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python compare/probe_vt.py", *sys.argv[1:]])
    means = [f"| {key} | {sum(v) / len(v):.2f} | {len(v)} |" for key, v in scores.items()]
    (out / "answers.md").write_text(
        f"# vt answers ({args.setting})\n\n`{command}` at {commit()}, one thread\n\n"
        "| policy | score (string_match_all) | samples |\n| --- | --- | --- |\n" + "\n".join(means)
        + "\n\n| sample | policy | score | answer |\n| --- | --- | --- | --- |\n" + "\n".join(lines) + "\n"
    )  # fmt: skip
    print((out / "answers.md").read_text())


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
