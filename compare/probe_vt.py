"""Which lines of a variable-tracking chain each policy keeps after the prompt (issue 40's vt probe).

A vt prompt hides one chain, "VAR A = 12345." then "VAR B = VAR A." ... "VAR E = VAR D.", in filler text, and asks
for every variable assigned 12345. This script reads exported samples (compare/kvpress/export_samples.py), records
each prompt's prefill once, replays it into each policy's cache (h2o_kv.studies.eval.shared, as the study does) and
counts, per chain line, the share of its tokens each (layer, KV head) still holds. The answer needs every line.

    OMP_NUM_THREADS=1 .venv/bin/python compare/probe_vt.py --samples compare/kvpress/samples-qwen-vt2k.jsonl \
        --n 10 --out results/qwen/probe-vt
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch

import h2o_kv
from h2o_kv.studies.eval.decoding import new_cache
from h2o_kv.studies.eval.shared import record_prefill, replay

CONFIGS = [(p, b) for b in (0.1, 0.2) for p in ("snapkv", "adakv", "h2o", "tova", "streamingllm")]


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


def kept_per_head(layer) -> list[set[int]]:
    """The positions each KV head of a batch-1 layer holds (a head-pooled AdaKV layer tags each slot's head)."""
    pos = layer.pos[0]
    if layer.head is None:
        return [set(row[row >= 0].tolist()) for row in pos]
    head, heads = layer.head[0, 0], layer.kv_heads
    return [set(pos[0][(head == h) & (pos[0] >= 0)].tolist()) for h in range(heads)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", required=True)
    parser.add_argument("--n", type=int, default=10)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    samples = [json.loads(line) for line in Path(args.samples).read_text().splitlines()[: args.n]]
    model, tokenizer = h2o_kv.load_model(samples[0]["model_dir"])
    shares: dict[str, list[list[float]]] = {}
    for sample in samples:
        ids = sample["input_ids"]
        text, ends = token_spans(tokenizer, ids)
        lines = chain_tokens(text, ends, sample["answers"])
        _, calls = record_prefill(model, ids)
        for policy, budget in CONFIGS:
            cache = replay(new_cache(policy, budget, sample["context_tokens"]), calls)  # as the study resolves it
            heads = [kept for layer in cache.layers for kept in kept_per_head(layer)]
            tokens = [sum(len(kept.intersection(line)) for kept in heads) / (len(line) * len(heads)) for line in lines]
            whole = [sum(kept.issuperset(line) for kept in heads) / len(heads) for line in lines]
            shares.setdefault(f"{policy} {budget:.0%}", []).append(tokens + whole)
        print(f"{sample['id']}: done", flush=True)
    table = {key: [sum(col) / len(col) for col in zip(*rows)] for key, rows in shares.items()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(
        json.dumps({"samples": args.samples, "n": len(samples), "shares": table}, indent=1)
    )
    n = len(next(iter(table.values()))) // 2
    head = "| policy | " + " | ".join(f"line {i + 1}" for i in range(n)) + " |"
    rows = [
        f"| {key} | " + " | ".join(f"{a:.2f} / {b:.2f}" for a, b in zip(v[:n], v[n:])) + " |"
        for key, v in table.items()
    ]
    (out / "table.md").write_text(
        f"Each chain line after the prompt: the share of its tokens held / the share of (layer, KV head) holding all "
        f"of it; means over the {len(samples)} first samples of {Path(args.samples).name}. Line 1 holds the number "
        "the question names; the answer needs every line.\n\n"
        + "\n".join([head, "|" + " --- |" * (n + 1), *rows])
        + "\n"
    )
    print((out / "table.md").read_text())


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
